package sessions

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// TestCutStatsLearnsLostExits: a provider whose cuts lose the exit stops being tried after
// a few failed tries (one in cutExplore skipped cuts is still tried), and one whose exits
// survive is tried whenever a replay would fetch anything again.
func TestCutStatsLearnsLostExits(t *testing.T) {
	var s cutStats
	assert.False(t, s.worthTrying(0), "a cut in the first step saves nothing")
	assert.True(t, s.worthTrying(700), "at the start: a rate of 1/2, 512 B a failed try")
	for range 10 {
		s.record(false, 300)
	}
	tried := 0
	for range 2 * cutExplore {
		if s.worthTrying(1400) {
			tried++
		}
	}
	assert.Equal(t, 2, tried, "only the exploring tries")

	var alive cutStats
	for range 10 {
		alive.record(true, 0)
	}
	assert.True(t, alive.worthTrying(200))
	var none *cutStats
	assert.True(t, none.worthTrying(1), "no stats: always try")
}
