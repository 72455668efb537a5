package handlers

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
)

// Routing between several providers (Config.Providers), learned by the fleet in Redis:
//
//   - A provider whose attempt ended exit_unavailable for a country (no peers there, after
//     the unit's session replays) is skipped for that country for RoutingConfig.NoPeersFor;
//     the job goes to the next provider at once, the attempt out of its budget.
//   - A destination that blocked an exit tier (403 and other 4xx, or a parser's blocked) is
//     sent to the next tier up for RoutingConfig.EscalateFor, after which the cheaper tier
//     is tried again; the job goes to the next tier at once, the attempt out of its budget.
//     A job starts on the cheapest tier its destination allows: providers are taken by
//     tier (datacenter, residential, mobile), then in their configured order.
//
// The destination is the host of the job's URL (lower case, with its port), or, for a job
// named by a source id, the kind ("kind:<name>": a kind scrapes one site). A unit never
// changes provider mid-way: routing picks the provider before the lease, for the whole
// attempt. Routing costs one pipelined Redis round trip per delivery and destination ×
// country every routeCacheTTL, and only with more than one provider.

// Routing defaults.
const (
	DefaultNoPeersFor  = 10 * time.Minute
	DefaultEscalateFor = time.Hour
	// routeCacheTTL is how long a worker uses what it read of a route before reading it
	// again: what another worker learned reaches this one within it.
	routeCacheTTL = 2 * time.Second
	// routeRetryDelay is how soon a job whose attempt taught the fleet a route runs again,
	// on the provider the route now names.
	routeRetryDelay = time.Second
	// maxReroutes × the providers bounds a job's uncounted attempts; past it a routing
	// failure is the job's own (decide).
	maxReroutes = 2
)

// RoutingConfig tunes the fleet's routing between providers.
type RoutingConfig struct {
	// NoPeersFor is how long a provider is skipped for a country after it had no exit
	// there. Defaults to DefaultNoPeersFor.
	NoPeersFor time.Duration
	// EscalateFor is how long a destination stays on the tier above the one it blocked.
	// Defaults to DefaultEscalateFor.
	EscalateFor time.Duration
}

// route is what the fleet knows of one destination × country.
type route struct {
	minTier int             // lowest tier rank the destination has not blocked lately
	noPeers map[string]bool // provider name → no exit in the country lately
	read    time.Time       // when it was read from Redis (r.cfg.Now)
}

// router holds the routes this worker read or learned.
type router struct {
	cfg   RoutingConfig
	keys  lua.Keys
	rdb   redis.UniversalClient
	mu    sync.Mutex
	cache map[string]*route // dest + "\x00" + country
	// byTier: the providers by tier rank, then configured order (stable).
	byTier []*providerSlot
}

func newRouter(cfg RoutingConfig, keys lua.Keys, rdb redis.UniversalClient, providers []*providerSlot) *router {
	if cfg.NoPeersFor <= 0 {
		cfg.NoPeersFor = DefaultNoPeersFor
	}
	if cfg.EscalateFor <= 0 {
		cfg.EscalateFor = DefaultEscalateFor
	}
	byTier := slices.Clone(providers)
	slices.SortStableFunc(byTier, func(a, b *providerSlot) int { return a.prov.Tier().Rank() - b.prov.Tier().Rank() })
	return &router{cfg: cfg, keys: keys, rdb: rdb, cache: map[string]*route{}, byTier: byTier}
}

// destination is the routing key of a job: its URL's host, or the kind.
func destination(k *kind, job tasks.Payload) string {
	if job.Spec.URL != "" {
		if u, err := url.Parse(job.Spec.URL); err == nil && u.Host != "" {
			return strings.ToLower(u.Host)
		}
	}
	return "kind:" + k.name
}

// get returns the route of dest × country: the cached one, or read from Redis (one
// pipeline: the destination's tier and each provider's no-peers mark). A Redis error
// gives the empty route (no routing) for this delivery and is not cached.
func (rt *router) get(ctx context.Context, dest, country string, now time.Time) *route {
	key := dest + "\x00" + country
	rt.mu.Lock()
	if c, ok := rt.cache[key]; ok && now.Sub(c.read) < routeCacheTTL && !now.Before(c.read) {
		rt.mu.Unlock()
		return c
	}
	rt.mu.Unlock()
	rctx, cancel := context.WithTimeout(ctx, hostRedisTimeout)
	defer cancel()
	pipe := rt.rdb.Pipeline()
	tier := pipe.Get(rctx, rt.keys.RouteTier(dest))
	marks := make([]*redis.StringCmd, len(rt.byTier))
	for i, s := range rt.byTier {
		marks[i] = pipe.Get(rctx, rt.keys.RouteNoPeers(s.prov.Name(), country))
	}
	if _, err := pipe.Exec(rctx); err != nil && !errors.Is(err, redis.Nil) {
		return &route{}
	}
	r := &route{noPeers: map[string]bool{}, read: now}
	if n, err := strconv.Atoi(tier.Val()); err == nil {
		r.minTier = n
	}
	for i, m := range marks {
		if m.Err() == nil {
			r.noPeers[rt.byTier[i].prov.Name()] = true
		}
	}
	rt.mu.Lock()
	if len(rt.cache) >= onceSetMax {
		clear(rt.cache)
	}
	rt.cache[key] = r
	rt.mu.Unlock()
	return r
}

// candidates are the providers a job of the route may run on, cheapest tier first: those
// of a tier the destination allows and with exits in the country. When the route rules
// out every provider, the no-peers marks are ignored first (a country may have come
// back), then the tier (the highest tier there is is the best left).
func (rt *router) candidates(r *route) []*providerSlot {
	pick := func(useTier, usePeers bool) []*providerSlot {
		var out []*providerSlot
		for _, s := range rt.byTier {
			if useTier && s.prov.Tier().Rank() < r.minTier || usePeers && r.noPeers[s.prov.Name()] {
				continue
			}
			out = append(out, s)
		}
		return out
	}
	if c := pick(true, true); len(c) > 0 {
		return c
	}
	if c := pick(true, false); len(c) > 0 {
		return c
	}
	top := rt.byTier[len(rt.byTier)-1].prov.Tier().Rank()
	return rt.byTier[slices.IndexFunc(rt.byTier, func(s *providerSlot) bool { return s.prov.Tier().Rank() == top }):]
}

// learn records what an attempt taught the fleet, in Redis and in this worker's cache at
// once. It returns the reason ("no_peers", "blocked") when the job should go to another
// provider now, or "" when the failure is the job's own (no other provider could do
// better).
func (rt *router) learn(ctx context.Context, slot *providerSlot, dest, country string, fe *sessions.FetchError, now time.Time) string {
	var key, val, reason string
	var ttl time.Duration
	known := rt.get(ctx, dest, country, now)
	// Another provider that can take the job now: not marked without exits in the
	// country, its breaker closed. Without one the failure is the job's (decide counts it),
	// so that a country no provider serves does not retry uncounted forever.
	other := func(ok func(*providerSlot) bool) bool {
		return slices.ContainsFunc(rt.byTier, func(s *providerSlot) bool {
			return s != slot && ok(s) && s.breaker.state() == nil
		})
	}
	switch fe.Category {
	case tasks.CategoryExitUnavailable:
		if !other(func(s *providerSlot) bool { return !known.noPeers[s.prov.Name()] }) {
			return ""
		}
		key, val, ttl, reason = rt.keys.RouteNoPeers(slot.prov.Name(), country), "1", rt.cfg.NoPeersFor, "no_peers"
	case tasks.CategoryBlocked:
		// A 403, or the parser's "blocked" (no status): not every 4xx (a 400, a paywall's
		// 402) says the exit tier is refused.
		if fe.Status != http.StatusForbidden && fe.Status != 0 {
			return ""
		}
		rank := slot.prov.Tier().Rank()
		if !other(func(s *providerSlot) bool { return s.prov.Tier().Rank() > rank }) {
			return ""
		}
		key, val, ttl, reason = rt.keys.RouteTier(dest), strconv.Itoa(rank+1), rt.cfg.EscalateFor, "blocked"
	default:
		return ""
	}
	rctx, cancel := detached(ctx)
	defer cancel()
	_ = rt.rdb.Set(rctx, key, val, ttl).Err() // lost: this worker still knows, the fleet relearns
	rt.mu.Lock()
	defer rt.mu.Unlock()
	c, ok := rt.cache[dest+"\x00"+country]
	if !ok {
		c = &route{read: now}
	}
	nc := &route{minTier: c.minTier, noPeers: map[string]bool{}, read: c.read}
	for p := range c.noPeers {
		nc.noPeers[p] = true
	}
	if reason == "no_peers" {
		nc.noPeers[slot.prov.Name()] = true
	} else {
		nc.minTier = max(nc.minTier, slot.prov.Tier().Rank()+1)
	}
	rt.cache[dest+"\x00"+country] = nc
	return reason
}

// pickProvider is step 0: the provider of this delivery. With one provider, or no router,
// the incident breakers alone decide (admitAny). Otherwise the first provider of the
// route's candidates whose breaker admits the delivery; when none admits, any provider
// whose breaker does (routing is a preference, incidents are not).
func (r *Registry) pickProvider(ctx context.Context, k *kind, job tasks.Payload) (*providerSlot, admission) {
	now := r.cfg.Now()
	if r.router == nil {
		return r.admitAny(now)
	}
	rt := r.router.get(ctx, destination(k, job), job.Spec.Country, now)
	for _, s := range r.router.candidates(rt) {
		if adm := s.breaker.admit(now); adm.ok {
			return s, adm
		}
	}
	return r.admitAny(now)
}

// rerouted handles an attempt whose failure taught the fleet a route: the job goes to
// the provider the route now names, at once, the attempt out of its budget. ok is false
// when the failure is the job's own.
func (r *Registry) rerouted(ctx context.Context, k *kind, job tasks.Payload, acq acquired, fe *sessions.FetchError, log *slog.Logger) (decision, bool) {
	// Uncounted attempts so far (reroutes, incidents): bounded, so that routes that keep
	// changing under a job can not retry it forever out of its budget.
	if r.router == nil || acq.Attempt.AttemptNo-acq.Attempt.BudgetAttemptNo >= maxReroutes*len(r.providers) {
		return decision{}, false
	}
	slot := acq.slot
	dest := destination(k, job)
	reason := r.router.learn(ctx, slot, dest, job.Spec.Country, fe, r.cfg.Now())
	if reason == "" {
		return decision{}, false
	}
	r.metrics.routeChanges.WithLabelValues(k.name, slot.prov.Name(), reason).Inc()
	if reason == "no_peers" {
		log.WarnContext(ctx, "route: the provider has no exit in the country; the fleet skips it there", "provider", slot.prov.Name(),
			"country", job.Spec.Country, "for", r.router.cfg.NoPeersFor)
	} else {
		log.WarnContext(ctx, "route: the destination blocked the exit tier; the fleet escalates it", "provider", slot.prov.Name(),
			"destination", dest, "tier", string(slot.prov.Tier()), "for", r.router.cfg.EscalateFor)
	}
	return decision{Retry: true, Category: fe.Category, Delay: routeRetryDelay}, true
}
