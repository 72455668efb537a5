package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/store/ops"
	"github.com/idemscrape/idemscrape/tasks"
)

var auditCmd = command{
	name: "audit",
	summary: "Check the invariants of the system of record: every complete job has exactly one result and one outbox\n" +
		"event; every result belongs to a complete job; a job running past -lease-max has a live asynq task;\n" +
		"no outbox event waits unsent past -outbox-lag; attempt fences strictly increase per job.\n" +
		"Exit 0 with a PASS table, or 1 naming each broken invariant and up to -examples job keys.",
	setFlags: func(fs *flag.FlagSet) func(context.Context, *cli, []string) error {
		cfg := ops.AuditConfig{}
		fs.DurationVar(&cfg.LeaseMax, "lease-max", ops.DefaultAuditLeaseMax, "longest lease any kind is given: a job running longer needs a live task")
		fs.DurationVar(&cfg.OutboxLagMax, "outbox-lag", ops.DefaultAuditOutboxLagMax, "longest an outbox event may wait unsent")
		fs.IntVar(&cfg.MaxExamples, "examples", ops.DefaultAuditMaxExamples, "job keys named per broken invariant")
		fs.IntVar(&cfg.BatchSize, "batch", ops.DefaultAuditBatchSize, "rows read per query (keyset page)")
		queue := fs.String("queue", "", "asynq queue of every job (default: each kind's, tasks.QueueFor; or IDEMSCRAPE_QUEUE)")
		asJSON := fs.Bool("json", false, "print JSON (snake_case fields) instead of a table")
		return func(ctx context.Context, c *cli, _ []string) error {
			if *queue == "" {
				*queue = env("IDEMSCRAPE_QUEUE", "")
			}
			// The flags checked by name (ops.AuditConfig.Validate names its fields, and takes
			// 0 for "the default").
			switch {
			case cfg.LeaseMax <= 0:
				return usageError{fmt.Sprintf("-lease-max %v must be positive", cfg.LeaseMax)}
			case cfg.OutboxLagMax <= 0:
				return usageError{fmt.Sprintf("-outbox-lag %v must be positive", cfg.OutboxLagMax)}
			case cfg.MaxExamples < 1:
				return usageError{fmt.Sprintf("-examples %d must be >= 1", cfg.MaxExamples)}
			case cfg.BatchSize < 1:
				return usageError{fmt.Sprintf("-batch %d must be >= 1", cfg.BatchSize)}
			}
			rc, err := redisConfig()
			if err != nil {
				return err
			}
			rdb := rc.NewClient()
			defer rdb.Close()
			cfg.TaskLive = taskLive(rdb, *queue)
			cfg.EventKeyPrefix = handlers.EventKey("")
			if err := cfg.Validate(); err != nil {
				return usageError{err.Error()}
			}
			pool, err := c.db(ctx)
			if err != nil {
				return err
			}
			rep, err := ops.New(pool).Audit(ctx, cfg)
			if err != nil {
				return err
			}
			if *asJSON {
				if err := writeJSON(c.stdout, struct {
					OK bool `json:"ok"`
					ops.AuditReport
				}{rep.OK(), rep}); err != nil {
					return err
				}
			} else if err := writeAudit(c.stdout, rep); err != nil {
				return err
			}
			if !rep.OK() {
				for _, inv := range rep.Broken() {
					fmt.Fprintf(c.stderr, "idemscrape audit: BROKEN %s: %d violation(s), e.g. %s\n", inv.Name, inv.Violations,
						strings.Join(inv.Examples, ", "))
				}
				return exitError{1}
			}
			return nil
		}
	},
}

// liveStates are the asynq task states in which a task will still run.
var liveStates = map[string]bool{"pending": true, "active": true, "scheduled": true, "retry": true, "aggregating": true}

// taskLive reads asynq's task hash (asynq:{<queue>}:t:<id>, field state) directly: an
// archived or completed task, or none, is not live.
func taskLive(rdb redis.UniversalClient, queue string) ops.TaskLiveFunc {
	return func(ctx context.Context, kind, key string) (bool, error) {
		q := queue
		if q == "" {
			q = tasks.QueueFor(kind)
		}
		state, err := rdb.HGet(ctx, "asynq:{"+q+"}:t:"+key, "state").Result()
		if errors.Is(err, redis.Nil) {
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("redis (IDEMSCRAPE_REDIS): %w", err)
		}
		return liveStates[state], nil
	}
}

func writeAudit(w io.Writer, rep ops.AuditReport) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "RESULT\tINVARIANT\tCHECKED\tVIOLATIONS\tEXAMPLES")
	for _, inv := range rep.Invariants {
		verdict := "PASS"
		if !inv.OK() {
			verdict = "FAIL"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\n", verdict, inv.Name, inv.Checked, inv.Violations, dash(strings.Join(inv.Examples, " ")))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if rep.OK() {
		fmt.Fprintln(w, "\nall invariants hold")
	} else {
		fmt.Fprintf(w, "\n%d invariant(s) broken\n", len(rep.Broken()))
	}
	return nil
}
