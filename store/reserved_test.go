package store_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestLostAttemptCarriesReservation: an attempt's start records what it reserved of its
// window's money budget; whoever raises the fence past it — a takeover's start (lone or
// grouped), the reconciler's rescue (lone or batched) — writes its row as lost with that
// reservation as its cost, since a killed worker never reports. The worker's own report,
// if it comes, replaces the charge by the real cost. The window's cost, which restores
// Redis's total after a loss, counts each attempt once. A bad reservation is refused
// before anything is written.
func TestLostAttemptCarriesReservation(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	usd := func(m int64) store.Cost { return store.Cost{Micros: m, Currency: "USD"} }
	startR := func(st interface {
		JobStart(context.Context, store.AttemptStartParams) (store.StartedAttempt, error)
	}, key string, token int64, reserved store.Cost) {
		t.Helper()
		_, err := st.JobStart(ctx, store.AttemptStartParams{Key: key, Token: token, Worker: "w1", Country: "US",
			ProxyEndpoint: "gw.example:7777", Owner: fmt.Sprintf("w1/%s/%d", key, token), Reserved: reserved})
		require.NoError(t, err)
	}
	costOf := func(key string, no int) (store.Cost, string) {
		t.Helper()
		atts, err := s.AttemptList(ctx, key)
		require.NoError(t, err)
		require.GreaterOrEqual(t, len(atts), no)
		return store.Cost{Micros: atts[no-1].CostMicros, Currency: atts[no-1].Currency}, atts[no-1].Outcome
	}
	windowCost := func() int64 {
		t.Helper()
		c, err := s.WindowCost(ctx, "catalog", "2026-04-23", "USD")
		require.NoError(t, err)
		return c
	}

	// Taken over by the next start: the lost row costs the reservation.
	record(t, s, "take")
	startR(s, "take", 1, usd(100))
	startR(s, "take", 2, usd(40))
	c, outcome := costOf("take", 1)
	assert.Equal(t, usd(100), c)
	assert.Equal(t, "lost", outcome)
	assert.EqualValues(t, 100, windowCost(), "the running attempt costs nothing yet; the lost one its reservation")

	// Its worker was not dead: its report replaces the charge, once.
	for range 2 {
		require.NoError(t, s.AttemptSupersede(ctx, store.AttemptSupersedeParams{Key: "take", Token: 1, Bytes: 30, Cost: usd(30)}))
		c, outcome = costOf("take", 1)
		assert.Equal(t, usd(30), c)
		assert.Equal(t, "superseded", outcome)
		assert.EqualValues(t, 30, windowCost(), "replaced, not added")
	}

	// Grouped starts do the same.
	g := s.NewGroupCommitter(0, 0)
	defer g.Close()
	record(t, s, "group")
	startR(g, "group", 1, usd(7))
	startR(g, "group", 2, store.Cost{})
	c, _ = costOf("group", 1)
	assert.Equal(t, usd(7), c)
	assert.EqualValues(t, 37, windowCost())

	// Rescued by the reconciler, lone and batched.
	record(t, s, "rescue")
	startR(s, "rescue", 1, usd(500))
	require.NoError(t, s.JobRescue(ctx, store.JobRescueParams{Key: "rescue", ExpectFence: 1, Token: 2}))
	c, outcome = costOf("rescue", 1)
	assert.Equal(t, usd(500), c)
	assert.Equal(t, "lost", outcome)
	record(t, s, "rescue-b")
	startR(s, "rescue-b", 1, usd(1000))
	errs, err := s.JobsRescue(ctx, []store.JobRescueParams{{Key: "rescue-b", ExpectFence: 1, Token: 2}})
	require.NoError(t, err)
	require.NoError(t, errs[0])
	c, _ = costOf("rescue-b", 1)
	assert.Equal(t, usd(1000), c)
	assert.EqualValues(t, 1537, windowCost())
	// A report of 0 (nothing fetched) leaves no cost and no currency.
	require.NoError(t, s.AttemptSupersede(ctx, store.AttemptSupersedeParams{Key: "rescue", Token: 1}))
	c, _ = costOf("rescue", 1)
	assert.Equal(t, store.Cost{}, c)
	assert.EqualValues(t, 1037, windowCost())

	// Without a window budget nothing is reserved: the lost row costs 0, without currency.
	record(t, s, "free")
	startR(s, "free", 1, store.Cost{})
	startR(s, "free", 2, store.Cost{})
	c, _ = costOf("free", 1)
	assert.Equal(t, store.Cost{}, c)

	// A finished attempt's later successor writes no lost row: the reservation of an
	// attempt that ended is never charged again.
	record(t, s, "done")
	startR(s, "done", 1, usd(90))
	require.NoError(t, s.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: "done", Token: 1, Category: "throttled", Bytes: 3, Cost: usd(3), NextAttemptAt: time.Now()}))
	startR(s, "done", 2, usd(90))
	c, outcome = costOf("done", 1)
	assert.Equal(t, usd(3), c)
	assert.Equal(t, "retryable", outcome)
	assert.EqualValues(t, 1040, windowCost())

	// Bad reservations are refused, naming what is wrong; nothing is written.
	record(t, s, "bad")
	before := testutil.TableSnapshot(t, pool, "jobs")
	for cost, want := range map[store.Cost]string{
		{Micros: -1, Currency: "USD"}: "cost -1 micro-units is negative",
		{Micros: 5}:                   "cost 5 micro-units has no currency",
		{Micros: 5, Currency: "usd"}:  `currency "usd" is not an ISO 4217 code`,
	} {
		for _, st := range []interface {
			JobStart(context.Context, store.AttemptStartParams) (store.StartedAttempt, error)
		}{s, g} {
			_, err := st.JobStart(ctx, store.AttemptStartParams{Key: "bad", Token: 1, Worker: "w1", Reserved: cost})
			require.ErrorContains(t, err, want)
			require.ErrorContains(t, err, `"bad"`)
		}
	}
	require.Equal(t, before, testutil.TableSnapshot(t, pool, "jobs"), "nothing written")
}

// TestAttemptBytesRecent: the bytes of a kind's recent attempts of finished jobs, newest
// first, lost attempts left out; a bad limit is refused.
func TestAttemptBytesRecent(t *testing.T) {
	ctx := context.Background()
	s := store.New(testutil.PG(t))
	for i, key := range []string{"r1", "r2", "r3"} {
		record(t, s, key)
		_, err := start(ctx, s, key, 1)
		require.NoError(t, err)
		if key == "r2" {
			_, err = start(ctx, s, key, 2) // attempt 1 lost
			require.NoError(t, err)
			require.NoError(t, s.JobFail(ctx, store.AttemptFinishParams{Key: key, Token: 2, Category: "parse_error", Bytes: 7}))
			continue
		}
		p := commitParams(key, 1)
		p.Bytes = int64(100 * (i + 1))
		_, err = s.Commit(ctx, p)
		require.NoError(t, err)
	}
	record(t, s, "r4") // pending: not finished
	got, err := s.AttemptBytesRecent(ctx, "catalog", 10)
	require.NoError(t, err)
	assert.Equal(t, []int64{300, 7, 100}, got)
	got, err = s.AttemptBytesRecent(ctx, "catalog", 2)
	require.NoError(t, err)
	assert.Equal(t, []int64{300, 7}, got)
	got, err = s.AttemptBytesRecent(ctx, "other", 10)
	require.NoError(t, err)
	assert.Empty(t, got)
	_, err = s.AttemptBytesRecent(ctx, "catalog", 0)
	require.ErrorContains(t, err, "limit 0 must be positive")
}

// TestAttemptProviderTier: the start records the provider and tier an attempt runs on;
// every writer of its row copies them — the worker's commit and failure record, a
// takeover's start, the rescue — and the running attempt shows them. A name too long is
// refused, naming it.
func TestAttemptProviderTier(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	startAs := func(key string, token int64, provider, tier string) {
		t.Helper()
		_, err := s.JobStart(ctx, store.AttemptStartParams{Key: key, Token: token, Worker: "w1", Country: "US",
			ProxyEndpoint: "gw.example:7777", Owner: fmt.Sprintf("w1/%s/%d", key, token), Provider: provider, Tier: tier,
			Reserved: store.Cost{Micros: 9, Currency: "USD"}})
		require.NoError(t, err)
	}
	type pt struct{ Provider, Tier, Outcome string }
	of := func(key string) []pt {
		t.Helper()
		atts, err := s.AttemptList(ctx, key)
		require.NoError(t, err)
		out := make([]pt, len(atts))
		for i, a := range atts {
			out[i] = pt{a.Provider, a.Tier, a.Outcome}
		}
		return out
	}
	record(t, s, "p")
	startAs("p", 1, "acct-a", "residential")
	atts, err := s.AttemptList(ctx, "p")
	require.NoError(t, err)
	require.Len(t, atts, 1)
	assert.Equal(t, pt{"acct-a", "residential", "running"}, pt{atts[0].Provider, atts[0].Tier, atts[0].Outcome})
	assert.Equal(t, store.Cost{Micros: 9, Currency: "USD"}, store.Cost{Micros: atts[0].CostMicros, Currency: atts[0].Currency},
		"the running attempt shows its reservation")
	startAs("p", 2, "acct-b", "datacenter") // takes over: attempt 1 lost
	require.NoError(t, s.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: "p", Token: 2, Category: "throttled", NextAttemptAt: time.Now()}))
	startAs("p", 3, "acct-b", "isp")
	_, err = s.Commit(ctx, commitParams("p", 3))
	require.NoError(t, err)
	record(t, s, "q")
	startAs("q", 1, "acct-c", "mobile")
	require.NoError(t, s.JobRescue(ctx, store.JobRescueParams{Key: "q", ExpectFence: 1, Token: 2}))
	assert.Equal(t, []pt{{"acct-a", "residential", "lost"}, {"acct-b", "datacenter", "retryable"}, {"acct-b", "isp", "complete"}}, of("p"))
	assert.Equal(t, []pt{{"acct-c", "mobile", "lost"}}, of("q"))

	record(t, s, "long")
	_, err = s.JobStart(ctx, store.AttemptStartParams{Key: "long", Worker: "w1", Provider: strings.Repeat("x", 65)})
	require.ErrorContains(t, err, `store: JobStart "long": provider name of 65 bytes is longer than 64`)
	_, err = s.JobStart(ctx, store.AttemptStartParams{Key: "long", Worker: "w1", Tier: strings.Repeat("x", 65)})
	require.ErrorContains(t, err, `tier of 65 bytes is longer than 64`)
}

// TestStatsByProvider: two accounts on one gateway, one of them on two tiers, are told
// apart; costs are per currency, and per completed attempt in whole micro-units.
func TestStatsByProvider(t *testing.T) {
	ctx := context.Background()
	s := store.New(testutil.PG(t))
	run := func(key, provider, tier string, costs ...int64) {
		t.Helper()
		record(t, s, key)
		for i, c := range costs {
			token := int64(i + 1)
			_, err := s.JobStart(ctx, store.AttemptStartParams{Key: key, Token: token, Worker: "w1", Country: "US",
				ProxyEndpoint: "gw.example:7777", Provider: provider, Tier: tier})
			require.NoError(t, err)
			cost := store.Cost{Micros: c, Currency: "USD"}
			if c == 0 {
				cost = store.Cost{}
			}
			if i < len(costs)-1 {
				require.NoError(t, s.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: key, Token: token, Category: "throttled",
					NextAttemptAt: time.Now(), Bytes: c, Cost: cost}))
				continue
			}
			p := commitParams(key, token)
			p.Bytes, p.Cost = c, cost
			_, err = s.Commit(ctx, p)
			require.NoError(t, err)
		}
	}
	run("a1", "acct-a", "residential", 10, 11)
	run("a2", "acct-a", "residential", 12)
	run("a3", "acct-a", "datacenter", 0)
	run("b1", "acct-b", "residential", 7)
	got, err := s.StatsByProvider(ctx)
	require.NoError(t, err)
	assert.Equal(t, []store.ProviderStats{
		{Provider: "acct-a", Tier: "datacenter", Attempts: 1, Charged: 0, Complete: 1, Bytes: 0, Costs: []store.ProviderCost{}},
		{Provider: "acct-a", Tier: "residential", Attempts: 3, Charged: 3, Complete: 2, Bytes: 33,
			Costs: []store.ProviderCost{{Currency: "USD", Micros: 33, Attempts: 3, PerCompleteMicros: 17}}},
		{Provider: "acct-b", Tier: "residential", Attempts: 1, Charged: 1, Complete: 1, Bytes: 7,
			Costs: []store.ProviderCost{{Currency: "USD", Micros: 7, Attempts: 1, PerCompleteMicros: 7}}},
	}, got)
	// The charged attempts are the ones the cost section counts (a3's free one in neither).
	costs, err := s.StatsCost(ctx)
	require.NoError(t, err)
	require.Len(t, costs, 1)
	assert.EqualValues(t, 4, costs[0].Attempts)
}

// TestJobAttemptReserve: a top-up raises the running attempt's recorded reservation, which
// its lost row then carries; a stale token, a smaller total, another currency or a bad
// cost write nothing.
func TestJobAttemptReserve(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	usd := func(m int64) store.Cost { return store.Cost{Micros: m, Currency: "USD"} }
	record(t, s, "t")
	_, err := s.JobStart(ctx, store.AttemptStartParams{Key: "t", Token: 1, Worker: "w1", Owner: "o1", Reserved: usd(10)})
	require.NoError(t, err)
	ok, err := s.JobAttemptReserve(ctx, "t", 1, usd(25))
	require.NoError(t, err)
	assert.True(t, ok)
	for _, c := range []store.Cost{usd(20), {Micros: 30, Currency: "EUR"}} {
		ok, err = s.JobAttemptReserve(ctx, "t", 1, c)
		require.NoError(t, err)
		assert.False(t, ok, "%v", c)
	}
	ok, err = s.JobAttemptReserve(ctx, "t", 2, usd(40))
	require.NoError(t, err)
	assert.False(t, ok, "not the running attempt")
	_, err = s.JobAttemptReserve(ctx, "t", 1, store.Cost{Micros: 5})
	require.ErrorContains(t, err, `store: JobAttemptReserve "t": cost 5 micro-units has no currency`)
	_, err = s.JobStart(ctx, store.AttemptStartParams{Key: "t", Token: 2, Worker: "w2", Owner: "o2"})
	require.NoError(t, err)
	atts, err := s.AttemptList(ctx, "t")
	require.NoError(t, err)
	assert.Equal(t, usd(25), store.Cost{Micros: atts[0].CostMicros, Currency: atts[0].Currency}, "the lost row carries the topped-up total")
}

// TestStatsBySession: attempts on warm sessions (session_units > 0, from the commit and
// from the failure record) and on new ones are added up apart, with bytes per attempt and
// the block rate; attempts without a session are left out; a bad SessionUnits is refused
// before anything is written.
func TestStatsBySession(t *testing.T) {
	ctx := context.Background()
	s := store.New(testutil.PG(t))
	got, err := s.StatsBySession(ctx)
	require.NoError(t, err)
	assert.Empty(t, got, "no attempts: no rows")
	start := func(key string, token int64) {
		t.Helper()
		_, err := s.JobStart(ctx, store.AttemptStartParams{Key: key, Token: token, Worker: "w1", Country: "US"})
		require.NoError(t, err)
	}
	commit := func(key string, token, bytes int64, units int) {
		t.Helper()
		start(key, token)
		p := commitParams(key, token)
		p.Bytes, p.SessionUnits = bytes, units
		_, err := s.Commit(ctx, p)
		require.NoError(t, err)
	}
	record(t, s, "n1")
	commit("n1", 1, 30000, 0)
	record(t, s, "w1")
	commit("w1", 1, 3000, 1)
	record(t, s, "w2")
	start("w2", 1)
	require.NoError(t, s.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: "w2", Token: 1, Category: "blocked",
		NextAttemptAt: time.Now(), Bytes: 1000, SessionID: "sess0007", SessionUnits: 7}))
	commit("w2", 2, 2000, 0)
	// An attempt that never reached a session (refused before any fetch) is left out.
	record(t, s, "x")
	start("x", 1)
	require.NoError(t, s.JobFail(ctx, store.AttemptFinishParams{Key: "x", Token: 1, Category: "budget_exceeded"}))
	got, err = s.StatsBySession(ctx)
	require.NoError(t, err)
	assert.Equal(t, []store.SessionStats{
		{Session: "new", Attempts: 2, Complete: 2, Bytes: 32000, BytesPerAttempt: 16000},
		{Session: "warm", Attempts: 2, Complete: 1, Blocked: 1, Bytes: 4000, BytesPerAttempt: 2000, BlockRate: 0.5},
	}, got)
	rows, err := s.Pool().Query(ctx, `SELECT session_units FROM attempts WHERE job_key = 'w2' ORDER BY attempt_no`)
	require.NoError(t, err)
	units, err := pgx.CollectRows(rows, pgx.RowTo[int])
	require.NoError(t, err)
	assert.Equal(t, []int{7, 0}, units, "psql sees what each attempt recorded")

	record(t, s, "bad")
	start("bad", 1)
	p := commitParams("bad", 1)
	p.SessionUnits = -1
	_, err = s.Commit(ctx, p)
	require.ErrorContains(t, err, "SessionUnits -1 is out of range")
	require.ErrorContains(t, s.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: "bad", Token: 1, Category: "blocked",
		NextAttemptAt: time.Now(), SessionUnits: -2}), "SessionUnits -2 is out of range")
	job, err := s.JobGet(ctx, "bad")
	require.NoError(t, err)
	assert.Equal(t, tasks.StateRunning, job.State, "nothing written")
}
