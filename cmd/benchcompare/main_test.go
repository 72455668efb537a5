package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemscrape/idemscrape/testutil"
)

// TestMain lets the test binary play the child process: the tool re-executes
// os.Executable(), which under `go test` is this binary.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == "-child" {
		if err := run(context.Background(), os.Args[1:], os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "benchcompare:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	goleak.VerifyTestMain(m) // fails the tests if a goroutine they started outlives them
}

func TestBenchCompare(t *testing.T) {
	ctx := context.Background()
	admin := func(t *testing.T) *pgx.Conn {
		conn, err := pgx.Connect(ctx, testutil.PGAdminDSN())
		require.NoError(t, err)
		t.Cleanup(func() { conn.Close(ctx) })
		return conn
	}
	countDBs := func(t *testing.T, conn *pgx.Conn, like string) int {
		var n int
		require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM pg_database WHERE datname LIKE $1`, like).Scan(&n))
		return n
	}

	t.Run("EndToEndTinyN", func(t *testing.T) {
		id := "t" + randomHex(4)
		var out bytes.Buffer
		err := run(ctx, []string{"-n", "50", "-pairs", "1", "-concurrency", "20", "-modes", strings.Join(allModes, ","), "-runid", id}, &out)
		require.NoError(t, err, out.String())
		table := out.String()
		for _, m := range allModes {
			assert.Contains(t, table, modeTitles[m])
		}
		assert.Len(t, strings.Split(strings.TrimSpace(table), "\n"), 2+len(allModes)+2+len(boxModes)+3,
			"header lines + one row per mode + whole-box title, header and rows + site requests, B4 and B6 lines:\n%s", table)
		assert.Contains(t, table, "Whole-box CPU µs/job")
		assert.Contains(t, table, "river c=20 ours 1.00 + 0.0200, peer 1.00 + 0.0000", "the River peer fetched the page once per job, no robots.txt")
		assert.Contains(t, table, "riverfast c=20 ours 1.00 + 0.0200, peer 1.00 + 0.0000")
		assert.Contains(t, table, "Site requests per job")
		assert.Contains(t, table, "B4 dispatch lag c=20")
		assert.Contains(t, table, "B6 Redis bytes per pending job")
		assert.NotContains(t, table, "NaN")
		assert.NotContains(t, table, "Inf")
		assert.Zero(t, countDBs(t, admin(t), "idemscrape_bc_"+id+"_%"), "every database of the run is dropped")
	})

	t.Run("ResidentialLatencyTinyN", func(t *testing.T) {
		// -site-delay: every page answers after the delay; ours and the River peer at its
		// fastest poll still complete every job, and the whole-box table is printed
		// (River at its defaults runs in EndToEndTinyN).
		id := "t" + randomHex(4)
		var out bytes.Buffer
		err := run(ctx, []string{"-n", "20", "-pairs", "1", "-concurrency", "20", "-site-delay", "300ms", "-modes", "riverfast", "-runid", id}, &out)
		require.NoError(t, err, out.String())
		table := out.String()
		assert.Contains(t, table, "site delay 300ms")
		assert.Contains(t, table, modeTitles["riverfast"])
		assert.Contains(t, table, "Whole-box CPU µs/job")
		assert.NotContains(t, table, "NaN")
		assert.Zero(t, countDBs(t, admin(t), "idemscrape_bc_"+id+"_%"), "every database of the run is dropped")
	})

	t.Run("PeerCmdRunsInThePeersPlace", func(t *testing.T) {
		// This test binary plays the -peer-cmd program: the columns are then the peer
		// against itself, run through the -peer-cmd path, and the robots.txt check holds.
		self, err := os.Executable()
		require.NoError(t, err)
		var out bytes.Buffer
		err = run(ctx, []string{"-n", "20", "-pairs", "1", "-concurrency", "5", "-modes", "b1,b1robots", "-peer-cmd", self, "-runid", "t" + randomHex(4)}, &out)
		require.NoError(t, err, out.String())
		assert.Contains(t, out.String(), "columns: ours = this tool's peer, peer = -peer-cmd")
		assert.Contains(t, out.String(), "b1 c=5 ours 1.00 + 0.0000, peer 1.00 + 0.0000")
		assert.Contains(t, out.String(), "b1robots c=5 ours 1.00 + 1.0000, peer 1.00 + 1.0000")
	})

	t.Run("ChildErrorReportedAndDatabaseDropped", func(t *testing.T) {
		// A child that fails reports its error through the parent (with its stderr), and
		// the run's database and redis-server are still removed.
		id := "t" + randomHex(4)
		o := options{n: 5, pairs: 1, conc: []int{2}, modes: []string{"b1"}, robots: true, pgDSN: testutil.PGAdminDSN(), runID: id}
		tpl, err := createTemplate(ctx, o.pgDSN, "idemscrape_bc_"+id+"_tpl")
		require.NoError(t, err)
		t.Cleanup(func() { dropMarked(ctx, o.pgDSN, tpl) })
		self, err := os.Executable()
		require.NoError(t, err)
		_, err = oneRun(ctx, self, o, tpl, "idemscrape_bc_"+id+"_1", runSpec{Mode: "bogus", Side: "peer", Conc: 2})
		require.Error(t, err)
		assert.Contains(t, err.Error(), `mode "bogus": unknown`)
		assert.Zero(t, countDBs(t, admin(t), "idemscrape_bc_"+id+"_1"), "the failed run's database is dropped")
	})

	t.Run("CheckRobots", func(t *testing.T) {
		assert.NoError(t, checkRobots("b1", "ours", 10, 1), "ours may fetch robots.txt (shared cache)")
		assert.NoError(t, checkRobots("b1", "peer", 10, 0))
		assert.Error(t, checkRobots("b1", "peer", 10, 10), "the b1 peer uses colly's default: no robots.txt")
		assert.Error(t, checkRobots("direct", "ext", 10, 1))
		assert.NoError(t, checkRobots("b1robots", "peer", 10, 10))
		assert.Error(t, checkRobots("river", "peer", 10, 1), "the River peer uses colly's default: no robots.txt")
		assert.Error(t, checkRobots("riverfast", "peer", 10, 1))
		assert.Error(t, checkRobots("b1robots", "ext", 10, 3), "the b1robots peer fetches robots.txt per job")
	})

	t.Run("DropsOnlyMarkedDatabases", func(t *testing.T) {
		conn := admin(t)
		name := "idemscrape_bc_t" + randomHex(4) + "_unmarked"
		_, err := conn.Exec(ctx, "CREATE DATABASE "+name)
		require.NoError(t, err)
		t.Cleanup(func() { _, _ = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+name) })
		dropMarked(ctx, testutil.PGAdminDSN(), name)
		assert.Equal(t, 1, countDBs(t, conn, name), "an unmarked database is left alone")

		_, err = conn.Exec(ctx, fmt.Sprintf("COMMENT ON DATABASE %s IS '%s'", name, dbComment))
		require.NoError(t, err)
		dropMarked(ctx, testutil.PGAdminDSN(), name)
		assert.Zero(t, countDBs(t, conn, name), "a marked database is dropped")
	})

	t.Run("PoolMustFitTheServer", func(t *testing.T) {
		// A pool larger than PostgreSQL's free connections fails before any run, naming
		// -pg-conns; -pg-conns sets the pool of both sides.
		err := run(ctx, []string{"-concurrency", "100000", "-modes", "b1"}, &bytes.Buffer{})
		require.Error(t, err)
		assert.Contains(t, err.Error(), "-pg-conns")
		o := options{conc: []int{100000}, pgConns: 5, pgDSN: testutil.PGAdminDSN()}
		assert.NoError(t, checkConnections(ctx, o))
		assert.Equal(t, 30, poolSize(0, 20))
		assert.Equal(t, 5, poolSize(5, 200))
	})

	t.Run("RejectsBadFlags", func(t *testing.T) {
		for _, args := range [][]string{
			{"-modes", "b9"}, {"-concurrency", "0"}, {"-n", "0"}, {"-runid", "X;"},
			{"-peer-cmd", "peer", "-modes", "b1,b3"}, {"-peer-cmd", "peer", "-modes", "river"},
			{"-site-delay", "-1s"}, {"-pg-conns", "-1"},
		} {
			err := run(ctx, args, &bytes.Buffer{})
			assert.Error(t, err, "%v", args)
		}
	})
}
