package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// progressMode is how the progress line is shown.
type progressMode int

const (
	// progressPlain prints a line when something changed, at most once a second (logs, CI).
	progressPlain progressMode = iota
	// progressTerminal redraws one line in place.
	progressTerminal
	// progressOff prints only the final line.
	progressOff
)

// progress is one reading of the run's state.
type progress struct {
	Done, Total, Complete int64
	Attempts, Bytes       int64
	Unsent                int64
	Inbox, Replays        int64 // consumed events and recognised replays
	Alerts                int64
	Entries               int64 // stream entries ever appended (every published copy)
}

func readProgress(ctx context.Context, pool *pgxpool.Pool, rdb redis.UniversalClient, streams []string) (progress, error) {
	var p progress
	err := pool.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE state IN ('complete', 'failed')), count(*), count(*) FILTER (WHERE state = 'complete'),
	COALESCE(sum(attempts), 0), COALESCE(sum(bytes_total), 0),
	(SELECT count(*) FROM outbox_unsent),
	(SELECT count(*) FROM outbox_inbox), (SELECT COALESCE(sum(replays), 0) FROM outbox_inbox),
	(SELECT count(*) FROM price_alerts)
FROM jobs`).Scan(&p.Done, &p.Total, &p.Complete, &p.Attempts, &p.Bytes, &p.Unsent, &p.Inbox, &p.Replays, &p.Alerts)
	if err != nil {
		return p, err
	}
	for _, stream := range streams {
		n, err := streamEntries(ctx, rdb, stream)
		if err != nil {
			return p, err
		}
		p.Entries += n
	}
	return p, nil
}

// streamEntries returns how many entries were ever appended to stream (XINFO STREAM
// entries-added): every published copy, including those the dispatcher has since trimmed
// (it trims what every consumer group acknowledged, by default). 0 if there is no stream yet.
func streamEntries(ctx context.Context, rdb redis.UniversalClient, stream string) (int64, error) {
	n, err := rdb.Exists(ctx, stream).Result()
	if err != nil || n == 0 {
		return 0, err
	}
	info, err := rdb.XInfoStream(ctx, stream).Result()
	if err != nil {
		return 0, err
	}
	return info.EntriesAdded, nil
}

// settled: every job is complete or failed, every outbox event was published, and every
// stream entry was consumed, either taking effect (an inbox row) or recognised as a replay.
func (p progress) settled() bool {
	return p.Total > 0 && p.Done == p.Total && p.Unsent == 0 && p.Entries > 0 && p.Inbox+p.Replays == p.Entries
}

func (p progress) state() string {
	return fmt.Sprintf("jobs %d/%d done · %s · %s through the proxy · events: %d took effect, %s skipped",
		p.Done, p.Total, plural(p.Attempts, "attempt"), humanBytes(p.Bytes), p.Inbox, plural(p.Replays, "replay"))
}

// waitSettled polls the run's state until it settled, showing progress as mode says.
func waitSettled(ctx context.Context, pool *pgxpool.Pool, rdb redis.UniversalClient, streams []string, mode progressMode, out io.Writer, began time.Time) error {
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	var last string
	var lastPrint time.Time
	for {
		p, err := readProgress(ctx, pool, rdb, streams)
		if err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("the run did not settle: %w", ctx.Err())
			}
			return err
		}
		state := p.state()
		l := fmt.Sprintf("[%5.1fs] %s", time.Since(began).Seconds(), state)
		done := p.settled()
		switch mode {
		case progressTerminal:
			fmt.Fprintf(out, "\r%s\033[K", l)
			if done {
				fmt.Fprintln(out)
			}
		case progressPlain:
			// Compare without the clock: print when the state changed.
			if done || (state != last && time.Since(lastPrint) >= time.Second) {
				fmt.Fprintln(out, l)
				last, lastPrint = state, time.Now()
			}
		case progressOff:
			if done {
				fmt.Fprintln(out, l)
			}
		}
		if done {
			return nil
		}
		select {
		case <-ctx.Done():
			if mode == progressTerminal {
				fmt.Fprintln(out)
			}
			return fmt.Errorf("the run did not settle (%s): %w", state, ctx.Err())
		case <-tick.C:
		}
	}
}

func humanBytes(b int64) string {
	switch {
	case b >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20))
	case b >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(b)/(1<<10))
	}
	return fmt.Sprintf("%d B", b)
}
