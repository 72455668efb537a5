package handlers

import (
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/idemscrape/idemscrape/internal/retry"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
)

// Policy is the retry policy of one failure category.
type Policy struct {
	// Retry: false makes the category terminal (the job fails at once).
	Retry bool
	// Base and Max bound the exponential backoff: the delay before attempt n+1 is drawn
	// uniformly from [0, min(Max, Base·2^(n-1))] ("full jitter"), and is at least the
	// destination's Retry-After.
	Base, Max time.Duration
}

// Retry defaults.
const (
	DefaultMaxAttempts     = 8
	DefaultTotalBudget     = 24 * time.Hour
	DefaultBandwidthBudget = 50 << 20
	// leaseBusyMaxDelay caps how long a delivery that found the lease busy waits.
	leaseBusyMaxDelay = 30 * time.Second
)

// DefaultPolicies is the per-category policy unless a kind overrides it. Deterministic
// failures of the job (robots, forbidden address, a name that does not resolve, a parser
// that can not read the response, validation, an unsafe step that may have run) are not
// retried. Bad proxy credentials are not the job's failure: they are an incident that stops
// the worker taking work (incident.go) while the jobs stay retryable.
var DefaultPolicies = map[tasks.Category]Policy{
	// proxy_auth is an incident (incident.go): the breaker decides the delay, no cap applies.
	tasks.CategoryProxyAuth:            {Retry: true, Base: DefaultIncidentProbeInterval, Max: DefaultIncidentProbeMax},
	tasks.CategoryExitUnavailable:      {Retry: true, Base: 30 * time.Second, Max: 10 * time.Minute},
	tasks.CategorySessionLost:          {Retry: true, Base: 5 * time.Second, Max: 2 * time.Minute},
	tasks.CategoryThrottled:            {Retry: true, Base: 30 * time.Second, Max: 30 * time.Minute},
	tasks.CategoryTimeout:              {Retry: true, Base: 10 * time.Second, Max: 5 * time.Minute},
	tasks.CategoryDestinationError:     {Retry: true, Base: 30 * time.Second, Max: 10 * time.Minute},
	tasks.CategoryNotFound:             {Retry: false},
	tasks.CategoryBlocked:              {Retry: true, Base: 5 * time.Minute, Max: time.Hour},
	tasks.CategoryRobotsDisallowed:     {Retry: false},
	tasks.CategoryForbiddenAddress:     {Retry: false},
	tasks.CategoryBodyTooLarge:         {Retry: false},
	tasks.CategoryUnsafeStepIncomplete: {Retry: false},
	tasks.CategoryParseError:           {Retry: false},
	tasks.CategoryValidation:           {Retry: false},
	tasks.CategoryLeaseLost:            {Retry: true, Base: time.Second, Max: 30 * time.Second},
	tasks.CategoryBudgetExceeded:       {Retry: false},
	tasks.CategoryPanic:                {Retry: true, Base: 10 * time.Second, Max: 5 * time.Minute},
	tasks.CategoryInternal:             {Retry: true, Base: 5 * time.Second, Max: 5 * time.Minute},
	tasks.CategoryInterrupted:          {Retry: true, Base: time.Second, Max: 30 * time.Second},
	tasks.CategoryNetwork:              {Retry: true, Base: 10 * time.Second, Max: 5 * time.Minute},
	tasks.CategoryDNSNotFound:          {Retry: false},
	// Not counted against the job's budget (see CategoryParserVersion).
	CategoryParserVersion: {Retry: true, Base: time.Minute, Max: 15 * time.Minute},
}

// RetryConfig is the retry policy of a job kind.
type RetryConfig struct {
	// Policies overrides DefaultPolicies per category.
	Policies map[tasks.Category]Policy
	// MaxAttempts caps the attempts of one job. Defaults to DefaultMaxAttempts.
	MaxAttempts int
	// TotalBudget caps the time from the job's creation to its last attempt. Defaults to
	// DefaultTotalBudget.
	TotalBudget time.Duration
	// BandwidthBudget caps the bytes all attempts of one job may move through the proxy.
	// Defaults to DefaultBandwidthBudget.
	BandwidthBudget int64
	// MoneyBudget caps what all attempts of one job may cost, in micro-units of the
	// provider's currency (sessions.Price; 0: no money budget). It is enforced like the
	// bandwidth budget, as the bytes it buys at the job's exit price: inside an attempt
	// (the unit stops at the cap) and between attempts (budget_exceeded). The bytes of
	// earlier attempts are costed at today's price. Registering a kind with a money budget
	// on a worker whose provider has no price is an error.
	MoneyBudget int64
}

func (c RetryConfig) withDefaults() (RetryConfig, error) {
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultMaxAttempts
	}
	if c.TotalBudget == 0 {
		c.TotalBudget = DefaultTotalBudget
	}
	if c.BandwidthBudget == 0 {
		c.BandwidthBudget = DefaultBandwidthBudget
	}
	switch {
	case c.MaxAttempts < 1:
		return c, fmt.Errorf("handlers: RetryConfig: MaxAttempts %d must be >= 1", c.MaxAttempts)
	case c.TotalBudget < 0:
		return c, fmt.Errorf("handlers: RetryConfig: TotalBudget %v is negative", c.TotalBudget)
	case c.BandwidthBudget < 0:
		return c, fmt.Errorf("handlers: RetryConfig: BandwidthBudget %d is negative", c.BandwidthBudget)
	case c.MoneyBudget < 0:
		return c, fmt.Errorf("handlers: RetryConfig: MoneyBudget %d is negative", c.MoneyBudget)
	}
	for cat, p := range c.Policies {
		if p.Retry && (p.Base <= 0 || p.Max < p.Base) {
			return c, fmt.Errorf("handlers: RetryConfig: policy %s needs 0 < Base <= Max", cat)
		}
	}
	return c, nil
}

func (c RetryConfig) policy(cat tasks.Category) Policy {
	if p, ok := c.Policies[cat]; ok {
		return p
	}
	if p, ok := DefaultPolicies[cat]; ok {
		return p
	}
	return DefaultPolicies[tasks.CategoryInternal]
}

// failureInput is what decide needs to know about a failed attempt.
type failureInput struct {
	Category   tasks.Category
	AttemptNo  int           // this attempt's number, from 1
	RetryAfter time.Duration // the destination's Retry-After, 0 if none
	JobAge     time.Duration // now − job creation
	JobBytes   int64         // bytes of all attempts, this one included
	JobCost    int64         // what JobBytes cost at the job's exit price (micro-units; 0 without a price)
	// NewSession: the destination refused the attempt's pooled session, which the pool
	// retired (workResult.blockRetired): the next attempt runs on another session, so it
	// waits only for RetryAfter — the host's, held for every worker by the politeness
	// host limiter — not for the category's backoff, which is for a job that meets the
	// same refusal again. A run whose 2 s sticky session was refused once waited
	// minutes for nothing. The attempt cap and the budgets apply all the same.
	NewSession bool
}

// decision is what happens to a job after a failed attempt.
type decision struct {
	Retry    bool
	Delay    time.Duration  // when Retry
	Category tasks.Category // recorded on the job: the failure's, or budget_exceeded
	Why      string         // why a retryable category still failed the job
}

// decide applies the policy of in.Category, then the job's budgets.
func (c RetryConfig) decide(in failureInput, rnd func() float64) decision {
	p := c.policy(in.Category)
	if !p.Retry {
		return decision{Category: in.Category}
	}
	budget := func(why string) decision {
		return decision{Category: tasks.CategoryBudgetExceeded, Why: why + " (last failure: " + string(in.Category) + ")"}
	}
	if in.AttemptNo >= c.MaxAttempts {
		return budget(fmt.Sprintf("%d attempts, the cap", in.AttemptNo))
	}
	if in.JobBytes > c.BandwidthBudget {
		return budget(fmt.Sprintf("%d bytes moved, over the %d-byte budget", in.JobBytes, c.BandwidthBudget))
	}
	// Money: spent means nothing left to buy a byte with (>=); bytes: over the budget (>),
	// as the attempt's byte cap lets it reach the budget exactly.
	if c.MoneyBudget > 0 && in.JobCost >= c.MoneyBudget {
		return budget(fmt.Sprintf("%d micro-units spent, the %d money budget", in.JobCost, c.MoneyBudget))
	}
	var delay time.Duration
	if !in.NewSession {
		delay = backoff(p, in.AttemptNo, rnd)
	}
	delay = max(delay, in.RetryAfter)
	if in.JobAge+delay > c.TotalBudget {
		return budget(fmt.Sprintf("next attempt in %v would pass the %v total budget", delay, c.TotalBudget))
	}
	return decision{Retry: true, Delay: delay, Category: in.Category}
}

// backoff is exponential backoff with full jitter: uniform in [0, min(Max, Base·2^(n-1))].
func backoff(p Policy, attemptNo int, rnd func() float64) time.Duration {
	return retry.Full(p.Base, p.Max, attemptNo, rnd)
}

func defaultRand() float64 { return rand.Float64() }

// attemptByteCap is how many bytes an attempt may still move: what is left of the job's
// bandwidth budget and, with a money budget, what is left of it at the exit's price per GB
// (bytes = micro-units × 10^9 ÷ price, rounded down; the earlier bytes costed at today's
// price). At least 1, so that an attempt that starts with nothing left stops at its first
// response as budget_exceeded.
//
// note says what the cap stands for when the money budget is the lesser ("" when it is the
// bandwidth budget): RunConfig.BudgetNote, so that budget_exceeded names the right budget.
func (c RetryConfig) attemptByteCap(price sessions.Price, country string, bytesSoFar int64) (capBytes int64, note string) {
	left := c.BandwidthBudget - bytesSoFar
	if c.MoneyBudget > 0 {
		money := c.MoneyBudget - price.Cost(bytesSoFar, country)
		if byMoney := price.Bytes(money, country); byMoney < left {
			left = byMoney
			note = fmt.Sprintf("the job's money budget: %d of %d micro-units %s left at %d micro-units/GB",
				max(money, 0), c.MoneyBudget, price.Currency, price.PerGB(country))
		}
	}
	return max(1, left), note
}
