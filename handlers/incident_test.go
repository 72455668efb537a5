package handlers

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/tasks"
)

// TestBreaker: the incident breaker's states — closed, open (deliveries handed back),
// one probe at a time, doubling intervals, and a probe that proves nothing keeps it open.
func TestBreaker(t *testing.T) {
	now := time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC)
	b := breaker{interval: 10 * time.Second, max: 30 * time.Second}
	require.True(t, b.admit(now).ok)
	require.NoError(t, b.state())

	opened, wait := b.trip(tasks.CategoryProxyAuth, "407", now, false)
	require.True(t, opened)
	require.Equal(t, 10*time.Second, wait)
	require.ErrorIs(t, b.state(), ErrIncident)
	adm := b.admit(now.Add(time.Second))
	require.False(t, adm.ok)
	require.Equal(t, 9*time.Second, adm.wait)
	opened, _ = b.trip(tasks.CategoryProxyAuth, "in flight", now.Add(time.Second), false)
	require.False(t, opened, "an in-flight delivery meeting the incident does not re-open it")

	// The probe: one delivery at a time; others come back after an interval, not a second.
	probe := b.admit(now.Add(10 * time.Second))
	require.True(t, probe.ok && probe.probe)
	other := b.admit(now.Add(11 * time.Second))
	require.False(t, other.ok)
	require.GreaterOrEqual(t, other.wait, 10*time.Second)

	// It meets the 407 again: the interval doubles (capped).
	_, wait = b.trip(tasks.CategoryProxyAuth, "407", now.Add(12*time.Second), true)
	require.Equal(t, 20*time.Second, wait)
	probe = b.admit(now.Add(32 * time.Second))
	require.True(t, probe.probe)
	_, wait = b.trip(tasks.CategoryProxyAuth, "407", now.Add(33*time.Second), true)
	require.Equal(t, 30*time.Second, wait, "capped at max")

	// A probe with no answer proves nothing: still open, the next delivery probes.
	probe = b.admit(now.Add(63 * time.Second))
	require.True(t, probe.probe)
	require.False(t, b.probeDone(false))
	require.ErrorIs(t, b.state(), ErrIncident)
	probe = b.admit(now.Add(63 * time.Second))
	require.True(t, probe.probe)
	require.True(t, b.probeDone(true), "an authenticated probe closes it")
	require.NoError(t, b.state())
	require.True(t, b.admit(now.Add(64*time.Second)).ok)

	require.Equal(t, probeRefused, probeVerdict(407))
	require.Equal(t, probeAuthenticated, probeVerdict(200))
	require.Equal(t, probeAuthenticated, probeVerdict(502), "a proxy error about the destination: the account authenticated")
	require.Equal(t, probeInconclusive, probeVerdict(0), "no answer (network error, timeout)")
}
