package handlers

import (
	"fmt"
	"slices"
	"sync"
	"time"
)

// LeaseLengths defaults.
const (
	DefaultLeaseLength     = 2 * time.Minute
	DefaultLeaseMin        = 10 * time.Second
	DefaultLeaseMax        = 30 * time.Minute
	DefaultLeasePercentile = 0.95
	DefaultLeaseMargin     = 2.0
	DefaultLeaseMinSamples = 20
	DefaultLeaseWindow     = 500
)

// LeaseLengthConfig configures LeaseLengths.
type LeaseLengthConfig struct {
	// Default is the lease length of a kind before MinSamples durations were observed.
	// Defaults to DefaultLeaseLength.
	Default time.Duration
	// Min and Max clamp every computed length. Default to DefaultLeaseMin and DefaultLeaseMax.
	Min, Max time.Duration
	// Percentile of the observed durations, in (0, 1]. Defaults to DefaultLeasePercentile.
	Percentile float64
	// Margin multiplies the percentile, >= 1. Defaults to DefaultLeaseMargin.
	Margin float64
	// MinSamples observed before the measured length replaces Default. Defaults to
	// DefaultLeaseMinSamples.
	MinSamples int
	// Window is how many recent durations per kind are kept. Defaults to DefaultLeaseWindow.
	Window int
}

// Validate fills in defaults and checks the config.
func (c *LeaseLengthConfig) Validate() error {
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	def(&c.Default, DefaultLeaseLength)
	def(&c.Min, DefaultLeaseMin)
	def(&c.Max, DefaultLeaseMax)
	if c.Percentile == 0 {
		c.Percentile = DefaultLeasePercentile
	}
	if c.Margin == 0 {
		c.Margin = DefaultLeaseMargin
	}
	if c.MinSamples == 0 {
		c.MinSamples = DefaultLeaseMinSamples
	}
	if c.Window == 0 {
		c.Window = DefaultLeaseWindow
	}
	switch {
	case c.Min <= 0 || c.Max < c.Min:
		return fmt.Errorf("handlers: LeaseLengthConfig: need 0 < Min (%v) <= Max (%v)", c.Min, c.Max)
	case c.Default < c.Min || c.Default > c.Max:
		return fmt.Errorf("handlers: LeaseLengthConfig: Default %v outside [Min, Max]", c.Default)
	case c.Percentile <= 0 || c.Percentile > 1:
		return fmt.Errorf("handlers: LeaseLengthConfig: Percentile %v outside (0, 1]", c.Percentile)
	case c.Margin < 1:
		return fmt.Errorf("handlers: LeaseLengthConfig: Margin %v below 1", c.Margin)
	case c.MinSamples < 1 || c.Window < c.MinSamples:
		return fmt.Errorf("handlers: LeaseLengthConfig: need 1 <= MinSamples (%d) <= Window (%d)", c.MinSamples, c.Window)
	}
	return nil
}

// LeaseLengths chooses the lease length of each job kind from the durations of its recent
// attempts: a high percentile times a margin, clamped. Too short a lease lets a second
// worker start while the first is still healthy; too long delays recovery after a crash.
// Safe for concurrent use.
type LeaseLengths struct {
	cfg   LeaseLengthConfig
	mu    sync.Mutex
	kinds map[string]*durationRing
}

// durationRing holds a kind's recent durations in arrival order (buf) and the same
// durations sorted (sorted), kept sorted on every Observe — an O(Window) move, no
// allocation — so that For reads the percentile without copying and sorting the window on
// every attempt.
type durationRing struct {
	buf    []time.Duration
	sorted []time.Duration
	next   int // where the next sample goes once buf is full
}

// insert adds d to sorted, keeping it sorted.
func (r *durationRing) insert(d time.Duration) {
	i, _ := slices.BinarySearch(r.sorted, d)
	r.sorted = slices.Insert(r.sorted, i, d)
}

// remove deletes one d from sorted.
func (r *durationRing) remove(d time.Duration) {
	if i, ok := slices.BinarySearch(r.sorted, d); ok {
		r.sorted = slices.Delete(r.sorted, i, i+1)
	}
}

// NewLeaseLengths returns a LeaseLengths; cfg may be nil for the defaults.
func NewLeaseLengths(cfg *LeaseLengthConfig) (*LeaseLengths, error) {
	var c LeaseLengthConfig
	if cfg != nil {
		c = *cfg
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return &LeaseLengths{cfg: c, kinds: map[string]*durationRing{}}, nil
}

// Observe records how long one attempt of kind held its lease.
func (l *LeaseLengths) Observe(kind string, d time.Duration) {
	if d <= 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.kinds[kind]
	if r == nil {
		r = &durationRing{buf: make([]time.Duration, 0, l.cfg.Window), sorted: make([]time.Duration, 0, l.cfg.Window)}
		l.kinds[kind] = r
	}
	if len(r.buf) < l.cfg.Window {
		r.buf = append(r.buf, d)
		r.insert(d)
		return
	}
	r.remove(r.buf[r.next])
	r.insert(d)
	r.buf[r.next] = d
	r.next = (r.next + 1) % l.cfg.Window
}

// For returns the lease length for the next attempt of kind.
func (l *LeaseLengths) For(kind string) time.Duration {
	l.mu.Lock()
	r := l.kinds[kind]
	if r == nil || len(r.sorted) < l.cfg.MinSamples {
		l.mu.Unlock()
		return l.cfg.Default
	}
	idx := int(float64(len(r.sorted))*l.cfg.Percentile+0.999999) - 1 // nearest-rank
	idx = max(0, min(idx, len(r.sorted)-1))
	p := r.sorted[idx]
	l.mu.Unlock()
	d := time.Duration(float64(p) * l.cfg.Margin)
	return max(l.cfg.Min, min(d, l.cfg.Max))
}
