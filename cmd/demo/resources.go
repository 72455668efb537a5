package main

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// The demo's names. A run id (8 hex digits) makes every run's database, key prefix and
// queue its own, so two demos, or a demo and the tests, never share or delete each other's
// state.
const (
	dbNamePrefix = "idemscrape_demo_"
	// dbMarkPrefix starts the COMMENT ON DATABASE of every database the demo creates; the
	// full mark names the run. The demo drops a database only when it carries its own run's
	// mark.
	dbMarkPrefix = "created by idemscrape demo, run "
	namePrefix   = "idemscrape-demo-"
)

// names is what one run owns.
type names struct {
	RunID    string
	Database string // idemscrape_demo_<run id>
	Mark     string // the database's comment
	Prefix   string // Redis key prefix of leases, fences, streams: idemscrape-demo-<run id>:
	Queue    string // asynq queue: idemscrape-demo-<run id>
}

func newNames(runID string) names {
	return names{
		RunID:    runID,
		Database: dbNamePrefix + runID,
		Mark:     dbMarkPrefix + runID,
		Prefix:   namePrefix + runID + ":",
		Queue:    namePrefix + runID,
	}
}

// createDatabase creates the run's database, marks it as the demo's and returns a pool on
// it. A database of that name that already exists is an error: the demo never adopts a
// database it did not create.
func createDatabase(ctx context.Context, adminDSN string, n names) (*pgxpool.Pool, error) {
	admin, err := pgx.Connect(ctx, adminDSN)
	if err != nil {
		return nil, fmt.Errorf("connect to PostgreSQL (is it running? `make services`): %w", err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	ident := pgx.Identifier{n.Database}.Sanitize()
	if _, err := admin.Exec(ctx, `CREATE DATABASE `+ident); err != nil {
		return nil, fmt.Errorf("create database %s: %w", n.Database, err)
	}
	// A literal, not a parameter: COMMENT takes no bind parameters. The mark is built from
	// hex digits only.
	if _, err := admin.Exec(ctx, `COMMENT ON DATABASE `+ident+` IS '`+strings.ReplaceAll(n.Mark, "'", "''")+`'`); err != nil {
		// Created but not marked: drop it now, we are the ones who just created it.
		_, _ = admin.Exec(context.WithoutCancel(ctx), `DROP DATABASE IF EXISTS `+ident+` WITH (FORCE)`)
		return nil, fmt.Errorf("mark database %s: %w", n.Database, err)
	}
	cfg, err := pgxpool.ParseConfig(adminDSN)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.Database = n.Database
	cfg.MaxConns = 20
	return pgxpool.NewWithConfig(ctx, cfg)
}

// errNotOurs: the database does not carry this run's mark; the demo leaves it alone.
var errNotOurs = errors.New("not created by this demo run (its comment is not the demo's mark): left alone")

// dropDatabase drops the run's database, and only if its comment is this run's mark. A
// database that does not exist is not an error.
func dropDatabase(ctx context.Context, adminDSN string, n names) error {
	admin, err := pgx.Connect(ctx, adminDSN)
	if err != nil {
		return fmt.Errorf("drop database %s: %w", n.Database, err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	var comment *string
	err = admin.QueryRow(ctx, `SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = $1`, n.Database).Scan(&comment)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return nil
	case err != nil:
		return fmt.Errorf("drop database %s: %w", n.Database, err)
	case comment == nil || *comment != n.Mark:
		return fmt.Errorf("drop database %s: %w", n.Database, errNotOurs)
	}
	if _, err := admin.Exec(ctx, `DROP DATABASE `+pgx.Identifier{n.Database}.Sanitize()+` WITH (FORCE)`); err != nil {
		return fmt.Errorf("drop database %s: %w", n.Database, err)
	}
	return nil
}

// redisPatterns are the SCAN patterns of every key the run creates: its own prefix and its
// asynq queue's keys (asynq names them asynq:{<queue>}:…). Neither contains a glob
// character: run ids are hex.
func redisPatterns(n names) []string {
	return []string{n.Prefix + "*", "asynq:{" + n.Queue + "}:*"}
}

// cleanupRedis deletes the run's keys (redisPatterns) and its queue's entry in asynq's set
// of queues, and nothing else. It never flushes. On a Redis Cluster it scans every master:
// SCAN sees only the keys of the node it runs on.
func cleanupRedis(ctx context.Context, rdb redis.UniversalClient, n names) error {
	scan := func(ctx context.Context, node redis.UniversalClient) error {
		for _, pattern := range redisPatterns(n) {
			iter := node.Scan(ctx, 0, pattern, 1000).Iterator()
			for iter.Next(ctx) {
				// Through rdb: on a cluster it routes the key to its slot's master.
				if err := rdb.Unlink(ctx, iter.Val()).Err(); err != nil {
					return fmt.Errorf("delete redis key %s: %w", iter.Val(), err)
				}
			}
			if err := iter.Err(); err != nil {
				return fmt.Errorf("scan redis keys %s: %w", pattern, err)
			}
		}
		return nil
	}
	if cc, ok := rdb.(*redis.ClusterClient); ok {
		if err := cc.ForEachMaster(ctx, func(ctx context.Context, node *redis.Client) error { return scan(ctx, node) }); err != nil {
			return err
		}
	} else if err := scan(ctx, rdb); err != nil {
		return err
	}
	return rdb.SRem(ctx, "asynq:queues", n.Queue).Err()
}
