package lua

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// ClaimRequest is one claim of ClaimMany: the arguments of Claim.
type ClaimRequest struct {
	Key   string        // job key
	Owner string        // the claimer
	TTL   time.Duration // lease length, at least 1ms
	Floor int64         // the job's fence in PostgreSQL: the token issued is above it
}

// ClaimMany claims every request's lease as Claim does, sending all the claims in one
// pipelined round trip (one EVALSHA of claim.lua each). leases[i] and errs[i] answer
// reqs[i]: errs[i] is nil, a *HeldError (errors.Is ErrLeaseHeld), a bad-argument error or
// the Redis error of that claim; the claims are independent (one failing does not undo the
// others). If Redis lost its script cache (restart, failover: NOSCRIPT), the script is
// loaded and the failed claims are sent again in a second pipeline. On a client that
// cannot pipeline (a bare redis.Scripter), the claims are sent one after another.
func (l *Leases) ClaimMany(ctx context.Context, reqs []ClaimRequest) ([]Lease, []error) {
	leases := make([]Lease, len(reqs))
	errs := make([]error, len(reqs))
	var (
		idx  []int
		keys [][]string
		args [][]any
	)
	for i, r := range reqs {
		if err := checkArgs(r.Key, r.Owner, r.TTL); err != nil {
			errs[i] = err
			continue
		}
		if r.Floor < 0 {
			errs[i] = fmt.Errorf("lua: claim %q: floor %d is negative", r.Key, r.Floor)
			continue
		}
		idx = append(idx, i)
		keys = append(keys, l.claimKeys(r.Key))
		args = append(args, l.claimArgs(r.Owner, r.TTL, r.Floor))
	}
	// The first send time for every claim, retried ones included: the lease ends no later
	// than Claimed + TTL, which an earlier Claimed only makes more conservative.
	sent := time.Now()
	cmds := l.runMany(ctx, claimScript, keys, args)
	for j, i := range idx {
		reply, err := cmds[j].Slice()
		leases[i], errs[i] = claimResult(reqs[i], sent, reply, err)
	}
	return leases, errs
}

// ReleaseMany releases every lease as Release does (the token counters stay), in one
// pipelined round trip. errs[i] answers leases[i]: nil, ErrLeaseLost, ErrNotOwner (both
// wrapped, as from Release), a bad-argument error or the Redis error of that release.
// NOSCRIPT is handled as in ClaimMany.
func (l *Leases) ReleaseMany(ctx context.Context, leases []Lease) []error {
	errs := make([]error, len(leases))
	var (
		idx  []int
		keys [][]string
		args [][]any
	)
	for i, lease := range leases {
		if err := checkLease(lease); err != nil {
			errs[i] = err
			continue
		}
		idx = append(idx, i)
		keys = append(keys, l.releaseKeys(lease))
		args = append(args, releaseArgs(lease, false))
	}
	cmds := l.runMany(ctx, releaseScript, keys, args)
	for j, i := range idx {
		n, err := cmds[j].Int64()
		errs[i] = statusErr("release", leases[i], n, err)
	}
	return errs
}

// pipeliner is a client that can pipeline (*redis.Client, *redis.ClusterClient, ...).
type pipeliner interface {
	Pipeline() redis.Pipeliner
}

// runMany is RunMany on the leases' client.
func (l *Leases) runMany(ctx context.Context, script *redis.Script, keys [][]string, args [][]any) []*redis.Cmd {
	return RunMany(ctx, l.rdb, script, keys, args)
}

// RunMany runs script once per keys[i], args[i] (args may be nil: no arguments), all in
// one pipeline of EVALSHA, and returns the commands, each with its own reply or error.
// go-redis's Script.Run falls back to EVAL on NOSCRIPT only outside a pipeline (a queued
// command's error is known only after Exec), so the commands that failed with NOSCRIPT
// are sent again, once, after SCRIPT LOAD. A client that can not pipeline runs them one
// by one.
func RunMany(ctx context.Context, rdb redis.Scripter, script *redis.Script, keys [][]string, args [][]any) []*redis.Cmd {
	argsOf := func(i int) []any {
		if args == nil {
			return nil
		}
		return args[i]
	}
	cmds := make([]*redis.Cmd, len(keys))
	p, ok := rdb.(pipeliner)
	if !ok {
		for i := range keys {
			cmds[i] = script.Run(ctx, rdb, keys[i], argsOf(i)...)
		}
		return cmds
	}
	send := func(which []int) {
		pipe := p.Pipeline()
		for _, i := range which {
			cmds[i] = script.EvalSha(ctx, pipe, keys[i], argsOf(i)...)
		}
		// Exec's error is the first command's; every command carries its own.
		_, _ = pipe.Exec(ctx)
	}
	all := make([]int, len(keys))
	for i := range all {
		all[i] = i
	}
	if len(all) == 0 {
		return cmds
	}
	send(all)
	var retry []int
	for i, c := range cmds {
		if redis.HasErrorPrefix(c.Err(), "NOSCRIPT") {
			retry = append(retry, i)
		}
	}
	if len(retry) == 0 {
		return cmds
	}
	if err := script.Load(ctx, rdb).Err(); err != nil {
		for _, i := range retry {
			cmds[i] = redis.NewCmd(ctx)
			cmds[i].SetErr(fmt.Errorf("script cache lost (NOSCRIPT) and SCRIPT LOAD failed: %w", err))
		}
		return cmds
	}
	send(retry)
	return cmds
}
