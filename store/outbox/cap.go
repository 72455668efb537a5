package outbox

import (
	"context"
	_ "embed"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/lua"
)

var (
	//go:embed cap.lua
	capSrc string

	capScript = redis.NewScript(lua.StreamIDFuncs + capSrc)
)

// defaultCapStep is the most entries one run of cap.lua removes, so that no single call
// holds Redis for long: removing 100,000 runner events and counting what each group lost
// took 2.7 ms on our 2-core box (Redis 7.0), 5–7 ms with groups whose lag Redis does not
// know. A stream further above the cap — the first trim of a stream that grew without
// one — is brought down by further calls right after the batch.
const defaultCapStep = 100_000

// maxCapCalls bounds the calls of one catch-up (see defaultCapStep): 100 × 100,000 entries.
// Whatever is left is removed at the next trim.
const maxCapCalls = 100

// capResult is one run of cap.lua.
type capResult struct {
	removed int64            // entries removed by this run
	over    int64            // entries still above the cap (the step bounded this run)
	first   string           // id of the first entry left ("" when nothing was removed)
	lost    map[string]int64 // group → removed entries it had not acknowledged (> 0 only)
}

// parseCapReply reads cap.lua's {removed, over, first, name, lost, …}.
func parseCapReply(v any) (capResult, error) {
	reply, ok := v.([]any)
	if !ok || len(reply) < 3 || len(reply)%2 != 1 {
		return capResult{}, fmt.Errorf("outbox: cap: unexpected reply %v", v)
	}
	var r capResult
	var okR, okO, okF bool
	r.removed, okR = reply[0].(int64)
	r.over, okO = reply[1].(int64)
	r.first, okF = reply[2].(string)
	if !okR || !okO || !okF || r.removed < 0 || r.over < 0 {
		return capResult{}, fmt.Errorf("outbox: cap: unexpected reply %v", v)
	}
	for i := 3; i < len(reply); i += 2 {
		name, okN := reply[i].(string)
		n, okL := reply[i+1].(int64)
		if !okN || !okL || n <= 0 {
			return capResult{}, fmt.Errorf("outbox: cap: unexpected reply %v", v)
		}
		if r.lost == nil {
			r.lost = make(map[string]int64)
		}
		r.lost[name] = n
	}
	return r, nil
}

// capArgs are cap.lua's ARGV.
func (d *Dispatcher) capArgs() []any {
	return []any{strconv.Itoa(d.cfg.MaxLen), strconv.Itoa(d.capStep)}
}

// capStream runs cap.lua on topic's stream on its own (EVALSHA, EVAL after a NOSCRIPT),
// records what it did, and calls again while the step left entries above the cap.
func (d *Dispatcher) capStream(ctx context.Context, topic string) {
	stream := StreamKey(d.cfg.Prefix, topic)
	for calls := 0; calls < maxCapCalls; calls++ {
		rctx, cancel := context.WithTimeout(ctx, d.cfg.RedisTimeout)
		v, err := capScript.Run(rctx, d.rdb, []string{stream}, d.capArgs()...).Result()
		cancel()
		if err != nil {
			d.log.WarnContext(ctx, "outbox: stream length cap failed; it runs again at the next trim", "topic", topic, "err", err)
			return
		}
		res, err := parseCapReply(v)
		if err != nil {
			d.log.WarnContext(ctx, "outbox: stream length cap failed; it runs again at the next trim", "topic", topic, "err", err)
			return
		}
		d.recordCap(ctx, topic, res)
		if res.over == 0 || res.removed == 0 {
			return
		}
	}
}

// lossWindow accumulates, per topic, what the cap took from consumer groups since the last
// log line about it.
type lossWindow struct {
	opened time.Time        // when the window's first line was written; zero: none yet
	named  map[string]bool  // groups named by the window's lines
	capped int64            // entries the cap removed since the last line
	lost   map[string]int64 // group → entries it lost since the last line
}

// recordCap counts one cap run in the metrics and logs losses, per topic: a line when the
// topic first loses entries, which opens a window of LossLogInterval; within the window a
// line only when a group not named yet loses entries; after it, the next loss writes a line
// and opens the next window. Each line carries what was lost since the previous one.
func (d *Dispatcher) recordCap(ctx context.Context, topic string, res capResult) {
	if res.removed == 0 {
		return
	}
	d.metrics.Capped.WithLabelValues(topic).Add(float64(res.removed))
	for g, n := range res.lost {
		d.metrics.CapLost.WithLabelValues(topic, g).Add(float64(n))
	}
	if len(res.lost) == 0 {
		d.log.DebugContext(ctx, "outbox: stream length cap removed entries every consumer group had acknowledged",
			"topic", topic, "removed", res.removed, "max_len", d.cfg.MaxLen)
		return
	}

	now := time.Now()
	d.trimMu.Lock()
	w := d.losses[topic]
	if w == nil {
		w = &lossWindow{lost: make(map[string]int64)}
		d.losses[topic] = w
	}
	w.capped += res.removed
	newGroup := false
	for g, n := range res.lost {
		w.lost[g] += n
		newGroup = newGroup || !w.named[g]
	}
	expired := w.opened.IsZero() || now.Sub(w.opened) >= d.cfg.LossLogInterval
	if !expired && !newGroup {
		d.trimMu.Unlock()
		return
	}
	if expired {
		w.opened, w.named = now, make(map[string]bool)
	}
	capped, lost := w.capped, w.lost
	for g := range lost {
		w.named[g] = true
	}
	w.capped, w.lost = 0, make(map[string]int64)
	d.trimMu.Unlock()

	groups := make([]string, 0, len(lost))
	for g := range lost {
		groups = append(groups, g)
	}
	slices.Sort(groups)
	perGroup := make([]any, 0, len(groups))
	for _, g := range groups {
		perGroup = append(perGroup, slog.Int64(g, lost[g]))
	}
	d.log.ErrorContext(ctx, "outbox: LOST events: the stream length cap removed entries that consumer groups had not acknowledged; "+
		"those groups will never handle them (a group that stopped reading, or one further behind than the cap allows: see docs/OPERATIONS.md, Bounded Redis)",
		"topic", topic, "groups", groups, slog.Group("lost", perGroup...), "capped", capped, "max_len", d.cfg.MaxLen,
		"log_window", d.cfg.LossLogInterval)
}
