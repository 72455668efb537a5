package outbox

import (
	"context"
	"fmt"
	"time"
)

// Prepared transactions (PREPARE TRANSACTION) and the horizon.
//
// Decision: the horizon (claimSQL) is scoped to this database. A transaction prepared in
// another database of the server holds back the server's oldest running transaction id
// (pg_snapshot_xmin, VACUUM's horizon) but not this database's dispatch: it is left out
// of the horizon like a running transaction that pg_stat_activity shows in another
// database, by its pg_prepared_xacts.database. A transaction prepared in this database
// holds every topic's dispatch back, legitimately (it may have inserted outbox rows, which
// COMMIT PREPARED makes visible with its old, small id), until it is committed or rolled
// back; the dispatcher reports one older than DispatcherConfig.PreparedAlertAge
// (idemscrape_outbox_horizon_held_by_prepared{database} and a WARN line naming it).
//
// Why leaving the other databases' transactions out is safe. A batch reads a row r only
// when r.xid < h, h being the smallest id in the batch's snapshot's in-progress list
// (pg_snapshot_xip) not shown to belong to another database, or the snapshot's xmax. A
// position only moves over rows it read; what must hold is that no row r' with (xid, id)
// below r's becomes visible after that snapshot (it would appear behind the position, and
// never be dispatched). Every row's xid is the id of the top-level transaction T that
// inserted it (the column's default, pg_current_xact_id(), which a subtransaction answers
// with its top-level id too). Take such a T:
//
//   - T had no id when the snapshot was taken, or an id >= xmax: ids are handed out in
//     increasing order, so T's rows have xid >= xmax >= h > r.xid. Not below r.
//   - T's id < xmax and not in the in-progress list: T had ended; if it committed the
//     snapshot sees its rows, so they are read with r or were behind the position already.
//     Nothing appears later.
//   - T's id is in the in-progress list and T belongs to this database: h <= T's id, so its
//     rows come after every row read. Transactions that commit out of id order are this
//     case: a smaller id that commits later is in progress, so it holds h at its id.
//   - T's id is in the list and T belongs to another database: T cannot insert into this
//     database's outbox at all. A session, and the transaction it prepares, is bound to
//     one database; the outbox table is not a shared catalog; COMMIT PREPARED runs in the
//     transaction's own database and only makes T's own writes visible. So there is no r'.
//
// The views name the database of the transaction holding that id: two transactions in
// progress at once never share an id, and the 32-bit id the views show (x::xid) is reused
// only after 2^31 more ids. Both views are read after the snapshot; a transaction that
// neither shows in another database (one that ended meanwhile, one caught while it
// prepares and is in neither view, one hidden from this role) counts, to be safe. So the
// guarantee is the same as with pg_snapshot_xmin alone; only a wrong database in those
// views could break it, and PostgreSQL fills both from the transaction's own session.

// Defaults of the prepared transaction check.
const (
	// DefaultPreparedAlertAge is how old a transaction prepared in the dispatcher's
	// database must be before the dispatcher reports it as holding the horizon.
	DefaultPreparedAlertAge = time.Minute
	// DefaultPreparedLogInterval is the least time between two log lines about one
	// prepared transaction (by gid) that stays prepared.
	DefaultPreparedLogInterval = 10 * time.Minute
)

// preparedSQL lists the transactions prepared in this database at least $1 seconds ago,
// oldest first; one row with a NULL gid when there are none (it still names the database).
const preparedSQL = `
SELECT current_database(), p.gid, p.transaction::text, p.owner::text, p.prepared,
	extract(epoch FROM clock_timestamp() - p.prepared)::float8
FROM (SELECT 1) one
LEFT JOIN pg_prepared_xacts p ON p.database = current_database()
	AND p.prepared <= clock_timestamp() - make_interval(secs => $1::float8)
ORDER BY p.prepared`

// preparedXact is a transaction prepared (PREPARE TRANSACTION) in the dispatcher's
// database: until it is committed or rolled back (COMMIT PREPARED / ROLLBACK PREPARED
// 'gid', run in that database), it holds every topic's dispatch back.
type preparedXact struct {
	GID      string        // the transaction's global identifier
	Database string        // the database it was prepared in (the dispatcher's)
	Xid      string        // its transaction id
	Owner    string        // the role that prepared it
	Prepared time.Time     // when it was prepared
	Age      time.Duration // how long ago, as PostgreSQL's clock reads
}

// checkPrepared is run by the background loop, at most once per preparedInterval: it
// lists the transactions prepared in this database longer than PreparedAlertAge ago, sets
// idemscrape_outbox_horizon_held_by_prepared{database} to their number and logs each at
// level WARN, once when first found and then once per DefaultPreparedLogInterval while it
// stays. A failed check is logged and tried again at the next interval.
func (d *Dispatcher) checkPrepared(ctx context.Context) {
	d.preparedMu.Lock()
	due := d.preparedChecked.IsZero() || time.Since(d.preparedChecked) >= d.preparedInterval()
	if due {
		d.preparedChecked = time.Now()
	}
	d.preparedMu.Unlock()
	if !due {
		return
	}
	if _, err := d.prepared(ctx); err != nil && ctx.Err() == nil {
		d.log.WarnContext(ctx, "outbox: checking for prepared transactions failed", "err", err)
	}
}

// preparedInterval is how often the loop checks: a quarter of PreparedAlertAge, but not
// more often than once per PollInterval.
func (d *Dispatcher) preparedInterval() time.Duration {
	return max(d.cfg.PollInterval, d.cfg.PreparedAlertAge/4)
}

// prepared runs the check itself (see checkPrepared) and returns what it found.
func (d *Dispatcher) prepared(ctx context.Context) ([]preparedXact, error) {
	qctx, cancel := context.WithTimeout(ctx, d.cfg.QueryTimeout)
	defer cancel()
	rows, err := d.pool.Query(qctx, preparedSQL, d.cfg.PreparedAlertAge.Seconds())
	if err != nil {
		return nil, fmt.Errorf("outbox: read pg_prepared_xacts: %w", err)
	}
	var (
		db              string
		gid, xid, owner *string
		at              *time.Time
		age             *float64
		found           []preparedXact
	)
	for rows.Next() {
		if err := rows.Scan(&db, &gid, &xid, &owner, &at, &age); err != nil {
			rows.Close()
			return nil, fmt.Errorf("outbox: read pg_prepared_xacts: %w", err)
		}
		if gid == nil {
			continue
		}
		p := preparedXact{GID: *gid, Database: db, Prepared: *at, Age: time.Duration(*age * float64(time.Second))}
		if xid != nil {
			p.Xid = *xid
		}
		if owner != nil {
			p.Owner = *owner
		}
		found = append(found, p)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("outbox: read pg_prepared_xacts: %w", err)
	}
	d.metrics.HeldByPrepared.WithLabelValues(db).Set(float64(len(found)))

	now := time.Now()
	d.preparedMu.Lock()
	defer d.preparedMu.Unlock()
	seen := make(map[string]time.Time, len(found))
	for _, p := range found {
		last, logged := d.preparedLogged[p.GID]
		if logged && now.Sub(last) < DefaultPreparedLogInterval {
			seen[p.GID] = last
			continue
		}
		seen[p.GID] = now
		d.log.WarnContext(ctx, "outbox: a prepared transaction holds every topic's dispatch back; end it with COMMIT PREPARED or ROLLBACK PREPARED (docs/OPERATIONS.md, IdemscrapeOutboxLag)",
			"gid", p.GID, "database", p.Database, "age", p.Age.Round(time.Second), "prepared", p.Prepared,
			"owner", p.Owner, "xid", p.Xid)
	}
	d.preparedLogged = seen // a transaction that ended is logged at once if its gid comes back
	return found, nil
}
