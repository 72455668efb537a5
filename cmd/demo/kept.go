package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"regexp"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
)

// sampleKey is a job of the run to try `idemscrape status` on: a complete one if any.
func sampleKey(ctx context.Context, pool *pgxpool.Pool) string {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var key string
	_ = pool.QueryRow(ctx, `SELECT key FROM jobs ORDER BY state <> 'complete', key LIMIT 1`).Scan(&key)
	return key
}

// runDSN is the admin DSN pointed at the run's database, without its password (never
// printed): withPassword says the reader must give it (IDEMSCRAPE_PG_PASSWORD). ok is false
// for a DSN that is not a URL.
func runDSN(adminDSN, database string) (dsn string, withPassword, ok bool) {
	u, err := url.Parse(adminDSN)
	if err != nil || u.Host == "" {
		return "", false, false
	}
	if u.User != nil {
		if _, set := u.User.Password(); set {
			u.User, withPassword = url.User(u.User.Username()), true
		}
	}
	q := u.Query()
	if q.Has("password") {
		q.Del("password")
		withPassword = true
		u.RawQuery = q.Encode()
	}
	u.Path = "/" + database
	return u.String(), withPassword, true
}

// redisEnv is the CLI's Redis variable for the demo's Redis.
func redisEnv(rc envflag.RedisConfig) string {
	if rc.IsCluster() {
		return "IDEMSCRAPE_REDIS_CLUSTER=" + strings.Join(rc.Cluster, ",")
	}
	if rc.TLS != nil || rc.Username != "" || rc.DB != 0 {
		return "IDEMSCRAPE_REDIS=<as given to the demo: " + strings.TrimPrefix(rc.String(), "redis ") + ">"
	}
	return "IDEMSCRAPE_REDIS=" + rc.Addr
}

// printKept says, at the end of a -keep run, what is kept, how to look at it with the CLI
// (the environment to set, a job key to try) and how to delete it.
func printKept(out io.Writer, o options, n names, key string) {
	fmt.Fprintf(out, "kept: database %s, Redis keys %s and asynq queue %s\n", n.Database, strings.Join(redisPatterns(n), ", "), n.Queue)
	fmt.Fprintln(out, "  look at it with the CLI:")
	dsn, withPassword, ok := runDSN(o.AdminDSN, n.Database)
	if ok {
		fmt.Fprintf(out, "    export IDEMSCRAPE_PG='%s'\n", dsn)
	} else {
		fmt.Fprintf(out, "    export IDEMSCRAPE_PG='<your -pg DSN with dbname=%s>'\n", n.Database)
	}
	if withPassword {
		fmt.Fprintln(out, "    export IDEMSCRAPE_PG_PASSWORD=...   (the -pg DSN's password, not printed)")
	}
	fmt.Fprintf(out, "    export %s IDEMSCRAPE_QUEUE=%s\n", redisEnv(o.Redis), n.Queue)
	if key != "" {
		fmt.Fprintf(out, "    go run ./cmd/idemscrape status '%s'\n", key)
	}
	fmt.Fprintln(out, "    go run ./cmd/idemscrape stats")
	fmt.Fprintf(out, "  delete it: go run ./cmd/demo -drop %s   (its database and Redis keys only, with the same -pg and -redis)\n", n.RunID)
}

// runIDRE is what a run id looks like (testutil.RandomID(4): 8 hex digits).
var runIDRE = regexp.MustCompile(`^[0-9a-f]{8}$`)

// dropRun deletes a kept run: its Redis keys and queue, and its database if it carries the
// run's mark (never another database).
func dropRun(ctx context.Context, adminDSN string, rc envflag.RedisConfig, runID string) error {
	if !runIDRE.MatchString(runID) {
		return fmt.Errorf("-drop %q: a run id is 8 hex digits, as the kept run printed it", runID)
	}
	n := newNames(runID)
	rdb := rc.NewClient()
	defer rdb.Close()
	return errors.Join(cleanupRedis(ctx, rdb, n), dropDatabase(ctx, adminDSN, n))
}
