package lua

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/redis/go-redis/v9"
)

var (
	//go:embed hostlimit.lua
	hostLimitSrc string
	//go:embed hostpause.lua
	hostPauseSrc string

	hostLimitScript = redis.NewScript(hostLimitSrc)
	hostPauseScript = redis.NewScript(hostPauseSrc)
)

// Limit is the fleet-wide request rate of one destination host.
type Limit struct {
	// Rate in requests per second. 0 means unpaced: only a host's pause (Retry-After) holds
	// requests back.
	Rate float64
	// Burst is how many requests may go back to back after an idle period. Defaults to 1.
	Burst int
}

// Validate reports a negative or non-finite rate or a negative burst.
func (l Limit) Validate() error {
	switch {
	case l.Rate < 0 || math.IsNaN(l.Rate) || math.IsInf(l.Rate, 0):
		return fmt.Errorf("lua: Limit.Rate %v must be a finite number >= 0 (requests per second)", l.Rate)
	case l.Burst < 0:
		return fmt.Errorf("lua: Limit.Burst %d must be >= 0 (0 means 1)", l.Burst)
	case l.Rate > 0 && l.Rate < 1e-6:
		return fmt.Errorf("lua: Limit.Rate %v is below one request per 11 days", l.Rate)
	}
	return nil
}

// HostLimits paces requests per destination host for a whole fleet: a GCRA bucket and a
// shared pause per host in Redis (hostlimit.lua, hostpause.lua), counted on the Redis
// server's clock. Both keys of a host share the hash tag {host:<host>}. It is the scripts'
// thin wrapper: politeness.Limits decides which limit a request gets, waits for the slot
// and shares a Retry-After through it.
type HostLimits struct {
	rdb  redis.Scripter
	keys Keys
}

// NewHostLimits returns HostLimits on rdb with keys under prefix.
func NewHostLimits(rdb redis.Scripter, prefix string) (*HostLimits, error) {
	keys, err := NewKeys(prefix)
	if err != nil {
		return nil, err
	}
	return &HostLimits{rdb: rdb, keys: keys}, nil
}

// Reserve asks for the next send slot of host under lim, in one round trip. If the slot is
// at most maxWait away it is reserved (every other worker's slots come after it) and
// Reserve returns its distance and true: send after that wait. Otherwise nothing is
// reserved and it returns the distance and false. A pause (Pause) holds the slot back as
// well, paced or not.
func (h *HostLimits) Reserve(ctx context.Context, host string, lim Limit, maxWait time.Duration) (time.Duration, bool, error) {
	if host == "" {
		return 0, false, errors.New("lua: reserve: empty host")
	}
	if err := lim.Validate(); err != nil {
		return 0, false, err
	}
	burst := max(lim.Burst, 1)
	var interval int64
	if lim.Rate > 0 {
		interval = int64(math.Ceil(1e6 / lim.Rate))
	}
	reply, err := hostLimitScript.Run(ctx, h.rdb,
		[]string{h.keys.HostTAT(host), h.keys.HostNotBefore(host)},
		interval, burst, max(maxWait, 0).Microseconds(),
	).Slice()
	if err != nil {
		return 0, false, fmt.Errorf("lua: reserve %q: %w", host, err)
	}
	if len(reply) == 2 {
		ok, okA := reply[0].(int64)
		wait, okB := reply[1].(int64)
		if okA && okB && wait >= 0 && (ok == 0 || ok == 1) {
			return time.Duration(wait) * time.Microsecond, ok == 1, nil
		}
	}
	return 0, false, fmt.Errorf("lua: reserve %q: unexpected reply %v", host, reply)
}

// Pause makes every worker's Reserve for host wait until d from now (server clock). It
// never shortens a longer pause already set, and reports whether it moved the pause later.
func (h *HostLimits) Pause(ctx context.Context, host string, d time.Duration) (bool, error) {
	if host == "" {
		return false, errors.New("lua: pause: empty host")
	}
	ms := d.Milliseconds()
	if ms < 1 {
		return false, fmt.Errorf("lua: pause %q: %v is below 1ms", host, d)
	}
	n, err := hostPauseScript.Run(ctx, h.rdb, []string{h.keys.HostNotBefore(host)}, ms).Int64()
	if err != nil {
		return false, fmt.Errorf("lua: pause %q: %w", host, err)
	}
	switch n {
	case 0, 1:
		return n == 1, nil
	}
	return false, fmt.Errorf("lua: pause %q: unexpected reply %d", host, n)
}
