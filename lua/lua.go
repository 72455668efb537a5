// Package lua holds idemscrape's Redis scripts (the *.lua files next to this one, embedded)
// and their thin Go wrappers: the lease of a job, taken, claimed, renewed and released
// atomically, and the counter token a Claim issues (the runner's token is PostgreSQL's); and the fleet-wide politeness of a destination
// host (HostLimits: a GCRA bucket and a shared Retry-After pause per host, on the server's
// clock; Unlock, robots.txt's fetch lock: package politeness drives both); and the trimming of an outbox stream (TrimStream: only entries every consumer
// group has delivered and acknowledged are removed).
//
// Two ways to hold a lease:
//   - Take (the runner's, one SET NX PX GET): the lease alone; the fencing token is the
//     fence PostgreSQL's attempt start issues (store.JobStart with Token 0). After the
//     job's commit, ReleaseCommitted drops it with one DEL.
//   - Claim / ClaimMany (the reconciler's rescue, reparse): the lease and a token from a
//     per-job counter in Redis, above the floor the caller passes (the fence PostgreSQL
//     holds).
//
// Guarantees:
//   - At most one owner holds a job's lease at a time, whichever way it was taken; the
//     lease expires on the Redis server's clock unless renewed.
//   - Every successful Claim returns a token strictly greater than every token issued before
//     by the counter for that job, and greater than the floor, so even a Redis that
//     restarted without persistence never repeats a token that PostgreSQL has accepted.
//   - Renew and Release succeed only for the claim that holds the lease (its owner, and for
//     a Claim its token).
//   - ReleaseDone (a job that completed) also deletes the job's token counter when it holds
//     the counter's last token, and ReleaseCommitted deletes lease and counter, so a
//     completed job keeps no key in Redis; a later claim's floor (the fence PostgreSQL
//     holds) still keeps its token above every token issued before.
//   - ClaimMany and ReleaseMany send many claims or releases in one pipelined round trip,
//     with the same per-item results as Claim and Release.
//   - TrimStream removes no entry that a consumer group has not delivered, or delivered and
//     not acknowledged; reading the groups and trimming are one atomic script.
//   - Unlock deletes a lock (robots.txt's fetch lock) only while its value is still the
//     caller's owner token: a holder that outlived its lock never deletes another's.
//   - All keys of one job share a hash tag, both keys of a destination host share one
//     ({host:<host>}), and the trim and unlock scripts touch one key each, so every script
//     runs on Redis Cluster (TestScriptsSingleSlot runs each on a real 3-master cluster).
//
// This package knows nothing of PostgreSQL: the caller passes the floor, or sets the token
// PostgreSQL issued, and raises the fence (store.JobStart).
package lua

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

var (
	//go:embed claim.lua
	claimSrc string
	//go:embed renew.lua
	renewSrc string
	//go:embed release.lua
	releaseSrc string

	claimScript   = redis.NewScript(claimSrc)
	renewScript   = redis.NewScript(renewSrc)
	releaseScript = redis.NewScript(releaseSrc)
)

// Sentinel errors of the lease scripts.
var (
	// ErrLeaseHeld: another owner holds the lease. The error is a *HeldError.
	ErrLeaseHeld = errors.New("lua: lease held by another owner")
	// ErrLeaseLost: the lease no longer exists (it expired or was deleted).
	ErrLeaseLost = errors.New("lua: lease lost")
	// ErrNotOwner: the lease exists but another owner, or another claim, holds it.
	ErrNotOwner = errors.New("lua: lease held by another owner or token")
)

// HeldError is returned by Claim when another owner holds the lease.
type HeldError struct {
	Key       string        // job key
	Holder    string        // owner holding the lease
	Remaining time.Duration // lease time left on the server clock
}

func (e *HeldError) Error() string {
	return fmt.Sprintf("lua: lease of %q held by %q for another %v", e.Key, e.Holder, e.Remaining)
}

// Is makes errors.Is(err, ErrLeaseHeld) true.
func (e *HeldError) Is(target error) bool { return target == ErrLeaseHeld }

// Lease is a claimed lease.
type Lease struct {
	Key   string // job key
	Owner string
	Token int64 // fencing token: present it to every write of the attempt
	TTL   time.Duration
	// Claimed is when the claim was sent, on the worker's clock: the lease ends no later
	// than Claimed + TTL, which is what the Keeper counts from.
	Claimed time.Time
	// taken: the lease came from Take. Redis holds the owner alone, and Token is the one
	// PostgreSQL's attempt start issued (the caller sets it), not the counter's.
	taken bool
}

// value is what Redis holds under the lease's key: "<token>:<owner>" for a Claim,
// "<owner>" for a Take (owners are unique per claim: see Take).
func (l Lease) value() string {
	if l.taken {
		return l.Owner
	}
	return strconv.FormatInt(l.Token, 10) + ":" + l.Owner
}

// Defaults of Leases.
const (
	// DefaultCounterTTL is how long a job's token counter outlives its last claim. After it
	// expires, the floor from PostgreSQL keeps tokens increasing.
	DefaultCounterTTL = 7 * 24 * time.Hour
)

// Leases claims, renews and releases job leases on one Redis (or Redis Cluster).
type Leases struct {
	rdb        redis.Cmdable
	keys       Keys
	counterTTL time.Duration
}

// NewLeases returns Leases on rdb with all keys under prefix (e.g. "idemscrape:").
func NewLeases(rdb redis.Cmdable, prefix string) (*Leases, error) {
	keys, err := NewKeys(prefix)
	if err != nil {
		return nil, err
	}
	return &Leases{rdb: rdb, keys: keys, counterTTL: DefaultCounterTTL}, nil
}

// Keys returns the key builder the leases use.
func (l *Leases) Keys() Keys { return l.keys }

// Claim claims the lease of job key for owner for ttl and returns it with a fresh fencing
// token greater than floor and than every token issued before. A claim by the owner that
// already holds the lease re-issues a higher token and restarts the lease (reparse does
// this when PostgreSQL holds a higher fence than Redis remembered). If another owner holds
// it, Claim returns a *HeldError (errors.Is ErrLeaseHeld).
func (l *Leases) Claim(ctx context.Context, key, owner string, ttl time.Duration, floor int64) (Lease, error) {
	if err := checkArgs(key, owner, ttl); err != nil {
		return Lease{}, err
	}
	if floor < 0 {
		return Lease{}, fmt.Errorf("lua: claim %q: floor %d is negative", key, floor)
	}
	sent := time.Now()
	reply, err := claimScript.Run(ctx, l.rdb, l.claimKeys(key), l.claimArgs(owner, ttl, floor)...).Slice()
	return claimResult(ClaimRequest{Key: key, Owner: owner, TTL: ttl, Floor: floor}, sent, reply, err)
}

func (l *Leases) claimKeys(key string) []string {
	return []string{l.keys.Lease(key), l.keys.Fence(key)}
}

func (l *Leases) claimArgs(owner string, ttl time.Duration, floor int64) []any {
	return []any{owner, ttl.Milliseconds(), floor, l.counterTTL.Milliseconds()}
}

// claimResult is the one place that maps claim.lua's reply (or the error of its call) to a
// Lease or an error; a malformed reply is an error, never a panic.
func claimResult(req ClaimRequest, sent time.Time, reply []any, err error) (Lease, error) {
	if err != nil {
		return Lease{}, fmt.Errorf("lua: claim %q: %w", req.Key, err)
	}
	if len(reply) == 2 && reply[0] == int64(1) {
		token, ok := reply[1].(int64)
		if !ok || token <= req.Floor {
			return Lease{}, fmt.Errorf("lua: claim %q: unexpected reply %v", req.Key, reply)
		}
		return Lease{Key: req.Key, Owner: req.Owner, Token: token, TTL: req.TTL, Claimed: sent}, nil
	}
	if len(reply) == 3 && reply[0] == int64(0) {
		holder, _ := reply[1].(string)
		pttl, _ := reply[2].(int64)
		return Lease{}, &HeldError{Key: req.Key, Holder: holder, Remaining: time.Duration(pttl) * time.Millisecond}
	}
	return Lease{}, fmt.Errorf("lua: claim %q: unexpected reply %v", req.Key, reply)
}

// Take takes the lease of job key for owner for ttl with one command (SET NX PX GET) and
// issues no token: the fencing token is the fence PostgreSQL's attempt start raises
// (store.JobStart with Token 0), which the caller sets as the returned lease's Token
// before it renews or releases it. owner must be unique per claim (the runner's owners
// are "<worker>/<random>"): Redis holds the owner alone, and Renew and Release recognise
// the lease by it. If another owner holds the lease, Take returns a *HeldError
// (errors.Is ErrLeaseHeld) with what a second round trip read of the holder's remaining
// time; a lease of an older worker (a "<token>:<owner>" STRING, or a HASH before that) is
// held as any other.
func (l *Leases) Take(ctx context.Context, key, owner string, ttl time.Duration) (Lease, error) {
	if err := checkArgs(key, owner, ttl); err != nil {
		return Lease{}, err
	}
	k := l.keys.Lease(key)
	sent := time.Now()
	prev, err := l.rdb.SetArgs(ctx, k, owner, redis.SetArgs{Mode: "NX", TTL: ttl, Get: true}).Result()
	switch {
	case errors.Is(err, redis.Nil): // the key was free: ours
		return Lease{Key: key, Owner: owner, TTL: ttl, Claimed: sent, taken: true}, nil
	case err == nil: // held: prev is the holder's value
		return Lease{}, l.held(ctx, key, holderOf(prev))
	case isWrongType(err):
		// An older worker's HASH lease (see claim.lua, rolling deploy): held.
		holder, _ := l.rdb.HGet(ctx, k, "owner").Result()
		return Lease{}, l.held(ctx, key, holder)
	}
	return Lease{}, fmt.Errorf("lua: take %q: %w", key, err)
}

// held is the *HeldError of a lease held by holder, with its remaining time (0 when the
// read fails or the lease expired in between).
func (l *Leases) held(ctx context.Context, key, holder string) error {
	pttl, _ := l.rdb.PTTL(ctx, l.keys.Lease(key)).Result()
	return &HeldError{Key: key, Holder: holder, Remaining: max(pttl, 0)}
}

// tokenPrefix is the "<token>:" a Claim lease's value starts with.
var tokenPrefix = regexp.MustCompile(`^[0-9]+:`)

// holderOf is the owner in a lease's value: "<token>:<owner>" (Claim) or "<owner>" (Take).
func holderOf(value string) string { return tokenPrefix.ReplaceAllString(value, "") }

func isWrongType(err error) bool {
	var re redis.Error
	return errors.As(err, &re) && strings.HasPrefix(re.Error(), "WRONGTYPE")
}

// ReleaseCommitted gives up the lease of a job whose commit succeeded, and the job's token
// counter with it, with one DEL and no owner check. That is safe only after the commit: the
// job is complete in PostgreSQL, which refuses every later start of it, so whoever might
// hold the lease by now (ours expired during the commit and another worker took it) can do
// nothing with it; and a later claim's floor is the fence PostgreSQL holds. A completed
// job keeps no key in Redis. The caller learns nothing about a loss here: the Keeper
// reports those.
func (l *Leases) ReleaseCommitted(ctx context.Context, lease Lease) error {
	if err := checkLease(lease); err != nil {
		return err
	}
	if err := l.rdb.Del(ctx, l.keys.Lease(lease.Key), l.keys.Fence(lease.Key)).Err(); err != nil {
		return fmt.Errorf("lua: release %q: %w", lease.Key, err)
	}
	return nil
}

// ReleaseCommittedMany is ReleaseCommitted for many leases in one pipelined round trip (one
// DEL each). errs[i] answers leases[i]: nil, a bad-argument error, or the Redis error of
// that DEL.
func (l *Leases) ReleaseCommittedMany(ctx context.Context, leases []Lease) []error {
	errs := make([]error, len(leases))
	cmds := make([]*redis.IntCmd, len(leases))
	_, _ = l.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, lease := range leases {
			if errs[i] = checkLease(lease); errs[i] == nil {
				cmds[i] = p.Del(ctx, l.keys.Lease(lease.Key), l.keys.Fence(lease.Key))
			}
		}
		return nil
	})
	for i, c := range cmds {
		if c != nil && c.Err() != nil {
			errs[i] = fmt.Errorf("lua: release %q: %w", leases[i].Key, c.Err())
		}
	}
	return errs
}

// Renew extends lease to ttl from now on the server clock. It fails with ErrLeaseLost if
// the lease expired or was deleted and ErrNotOwner if another claim holds it.
func (l *Leases) Renew(ctx context.Context, lease Lease, ttl time.Duration) error {
	if err := checkArgs(lease.Key, lease.Owner, ttl); err != nil {
		return err
	}
	n, err := renewScript.Run(ctx, l.rdb, []string{l.keys.Lease(lease.Key)},
		lease.value(), ttl.Milliseconds()).Int64()
	return statusErr("renew", lease, n, err)
}

// Release gives lease up and keeps the job's token counter, so the next claim still gets a
// higher token. It fails with ErrLeaseLost if the lease expired or was deleted and
// ErrNotOwner if another claim holds it; either way the caller no longer holds it.
func (l *Leases) Release(ctx context.Context, lease Lease) error {
	return l.release(ctx, lease, false)
}

// ReleaseDone gives the lease of a job that is terminal (its commit succeeded: it never runs
// again) up and deletes the job's token counter with it, so a completed job leaves no key
// in Redis. The counter is deleted only if this lease holds the last token issued; a later
// claim (a duplicate delivery, an operator requeue) still gets a token above the fence
// PostgreSQL holds, which it passes as the floor. Errors as Release; on an error nothing is
// deleted.
func (l *Leases) ReleaseDone(ctx context.Context, lease Lease) error {
	return l.release(ctx, lease, true)
}

func (l *Leases) release(ctx context.Context, lease Lease, terminal bool) error {
	if err := checkLease(lease); err != nil {
		return err
	}
	n, err := releaseScript.Run(ctx, l.rdb, l.releaseKeys(lease), releaseArgs(lease, terminal)...).Int64()
	return statusErr("release", lease, n, err)
}

func (l *Leases) releaseKeys(lease Lease) []string {
	return []string{l.keys.Lease(lease.Key), l.keys.Fence(lease.Key)}
}

func releaseArgs(lease Lease, terminal bool) []any {
	flag := "0"
	if terminal {
		flag = "1"
	}
	token := lease.Token
	if lease.taken {
		token = 0 // not the counter's: the counter is deleted only for its own last token
	}
	return []any{lease.value(), token, flag}
}

func checkLease(lease Lease) error {
	if lease.Key == "" || lease.Owner == "" {
		return errors.New("lua: release: lease without key or owner")
	}
	return nil
}

// statusErr is the one place that maps a status script's integer reply to an error.
func statusErr(op string, lease Lease, n int64, err error) error {
	if err != nil {
		return fmt.Errorf("lua: %s %q: %w", op, lease.Key, err)
	}
	switch n {
	case 1:
		return nil
	case -1:
		return fmt.Errorf("lua: %s %q token %d: %w", op, lease.Key, lease.Token, ErrLeaseLost)
	case -2:
		return fmt.Errorf("lua: %s %q token %d: %w", op, lease.Key, lease.Token, ErrNotOwner)
	}
	return fmt.Errorf("lua: %s %q: unexpected reply %d", op, lease.Key, n)
}

func checkArgs(key, owner string, ttl time.Duration) error {
	switch {
	case key == "":
		return errors.New("lua: empty job key")
	case owner == "":
		return fmt.Errorf("lua: %q: empty owner", key)
	case ttl < time.Millisecond:
		return fmt.Errorf("lua: %q: lease length %v is below 1ms", key, ttl)
	}
	return nil
}
