package handlers

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
)

// TestAttemptByteCap: the bytes an attempt may move are what is left of the bandwidth
// budget and of the money budget at the exit's price, whichever is less, at least 1.
func TestAttemptByteCap(t *testing.T) {
	capOf := func(c RetryConfig, price sessions.Price, country string, soFar int64) int64 {
		n, _ := c.attemptByteCap(price, country, soFar)
		return n
	}
	price := sessions.Price{Currency: "USD", MicrosPerGB: 8_000_000, ByCountry: map[string]int64{"DE": 10_000_000}}
	c := RetryConfig{BandwidthBudget: 1 << 20, MoneyBudget: 5_000} // 5,000 µUSD = 625,000 bytes at 8 USD/GB
	require.Equal(t, int64(625_000), capOf(c, price, "US", 0))
	require.Equal(t, int64(500_000), capOf(c, price, "de", 0), "the country's price")
	require.Equal(t, int64(425_000), capOf(c, price, "US", 200_000), "200,000 earlier bytes cost 1,600")
	require.Equal(t, int64(1), capOf(c, price, "US", 700_000), "spent: 1 byte, so the attempt stops at once")
	require.Equal(t, int64(1<<20), capOf(RetryConfig{BandwidthBudget: 1 << 20}, price, "US", 0), "no money budget")
	require.Equal(t, int64(1<<20-10), capOf(c, sessions.Price{}, "US", 10), "no price: the bandwidth budget alone")
	require.Equal(t, int64(1<<20), capOf(RetryConfig{BandwidthBudget: 1 << 20, MoneyBudget: math.MaxInt64}, price, "US", 0),
		"a budget too large to convert leaves the bandwidth budget")
	_, note := c.attemptByteCap(price, "US", 0)
	require.Equal(t, "the job's money budget: 5000 of 5000 micro-units USD left at 8000000 micro-units/GB", note)
	_, note = RetryConfig{BandwidthBudget: 1000, MoneyBudget: 5_000}.attemptByteCap(price, "US", 0)
	require.Empty(t, note, "the bandwidth budget is the lesser")
}

// TestDecideMoneyBudget: a retryable failure of a job that has spent its money budget
// fails the job as budget_exceeded, naming the amounts.
func TestDecideMoneyBudget(t *testing.T) {
	c, err := RetryConfig{MoneyBudget: 1_000}.withDefaults()
	require.NoError(t, err)
	rnd := func() float64 { return 0 }
	in := failureInput{Category: tasks.CategoryThrottled, AttemptNo: 1, JobCost: 999}
	require.True(t, c.decide(in, rnd).Retry)
	in.JobCost = 1_000
	d := c.decide(in, rnd)
	require.False(t, d.Retry)
	require.Equal(t, tasks.CategoryBudgetExceeded, d.Category)
	require.Contains(t, d.Why, "1000 micro-units spent, the 1000 money budget")
	_, err = RetryConfig{MoneyBudget: -1}.withDefaults()
	require.ErrorContains(t, err, "MoneyBudget -1 is negative")
}

// TestWindowHoldCap: a reservation of the attempt's whole cap never caps it below its own
// budgets, whatever the rounding of bytes → money → bytes at the price; a smaller one (the
// measured cost per attempt, or the window's last money) caps it at the bytes it buys.
func TestWindowHoldCap(t *testing.T) {
	for _, perGB := range []int64{3_000_000, 4_000_000, 8_400_000, 12_750_000} {
		price := sessions.Price{Currency: "USD", MicrosPerGB: perGB}
		c, err := RetryConfig{}.withDefaults()
		require.NoError(t, err)
		capBytes, _ := c.attemptByteCap(price, "US", 0)
		wanted := price.Cost(capBytes, "US")
		full := &windowHold{window: "w", amount: wanted, wanted: wanted, price: price}
		require.Equal(t, capBytes, full.bytes(capBytes, "US"), "%d micro/GB", perGB)
		part := &windowHold{window: "w", amount: wanted / 2, wanted: wanted, price: price}
		got := part.bytes(capBytes, "US")
		require.Less(t, got, capBytes)
		require.LessOrEqual(t, price.Cost(got, "US"), part.amount, "the bytes cost at most what is reserved")
		require.Contains(t, part.spentNote("k", 1_000_000), `the money budget of window "w" of kind k`)
	}
}
