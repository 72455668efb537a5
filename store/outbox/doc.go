// Package outbox publishes committed outbox events from PostgreSQL to Redis Streams and
// consumes them with an exactly-once effect.
//
// # Producing
//
// A committer inserts a row into the outbox table (event_key, topic, payload) in the same
// transaction as the result it describes, and runs NOTIFY on [NotifyChannel] (the payload
// may be empty) so that dispatchers wake at once instead of at their next poll. A commit
// that forgets the NOTIFY is still dispatched, one poll interval later.
//
// There is no per-row sent mark (migration 00020). Each row carries the id of the
// transaction that inserted it (outbox.xid, filled by the column's default: the commit's
// INSERT does not name it), and each topic has one position in PostgreSQL
// (outbox_positions: the (xid, id) of the last row dispatched). A row is dispatched when
// (xid, id) <= its topic's position; the view outbox_unsent lists the others.
//
// A [Dispatcher] batch takes, in one transaction, a topic that has rows waiting and whose
// position no other dispatcher holds (FOR UPDATE SKIP LOCKED on the position's row), reads
// up to BatchSize of its rows after the position in (xid, id) order and behind the horizon
// (below), checks that the epoch marker of the topic's stream is there and whole (one
// pipelined script call, see Redis data loss below), appends them with one pipelined round
// of XADD to the stream <prefix>stream:{<topic>} (see [StreamKey]), and only then moves the
// position past them and commits: two row writes per batch (the position and the stream's
// entries-added), none per event. Any number of dispatchers may run at once, in one process
// or many: the dispatchers of one topic take turns, those of different topics work side by
// side, each serving the topics in turn. Topics without a position get one, at the start,
// when a dispatcher finds no batch and at least once per PollInterval. Guarantees:
//
//   - The horizon: a row is read only when every transaction that could still insert a row
//     before it in (xid, id) order has ended: its xid is below the smallest xid still
//     running when the batch's snapshot was taken that may belong to this database
//     (pg_stat_activity and pg_prepared_xacts show the others, open or prepared; ones
//     they do not place in another database count, to be safe; the proof is in
//     prepared.go). So no row ever appears behind a position, and rows are published in
//     (xid, id) order per topic: commit order, except that rows of a transaction that
//     took its xid first and committed later go before the rows that waited for it.
//     A write transaction left open on the database (any transaction that took an xid:
//     an INSERT, UPDATE, DELETE, SELECT … FOR UPDATE, even on another table) holds every
//     topic's dispatch back until it ends: idemscrape_outbox_dispatch_lag_seconds and
//     [Lag] (the reconciler's idemscrape_reconciler_outbox_oldest_unsent_seconds) show it.
//     Keep write transactions short (idle_in_transaction_session_timeout helps). So does a
//     transaction prepared in this database (PREPARE TRANSACTION), until COMMIT PREPARED
//     or ROLLBACK PREPARED: the dispatchers report one prepared longer than
//     PreparedAlertAge ago (idemscrape_outbox_horizon_held_by_prepared and a WARN line
//     naming its gid, database and age). Transactions of other databases of the server,
//     open or prepared, hold nothing back.
//   - The position moves only after the batch's XADDs succeeded. If Redis is down, a
//     publish is retried a bounded number of times with backoff and jitter, then the
//     transaction rolls back and the rows are read again later.
//   - A crash, a failed position update, a failed commit or the AfterPublish failpoint
//     between XADD and commit republishes the batch: the stream may hold an event more
//     than once (with the same event_key and outbox_id). Consumers recognise the replay by
//     event_key.
//   - Within a topic, events reach the stream in that order, replays aside; consumers
//     still must not rely on it (a replay comes after later events).
//
// # Redis data loss
//
// A row is dispatched once its XADD succeeded; if Redis then loses its data (restarted
// without persistence, FLUSHALL, a cluster node replaced empty), the entries not yet
// consumed are gone. The dispatchers find such a loss and publish those events again.
// PostgreSQL is the witness: it keeps each stream's epoch (table outbox_epochs, migration
// 00007, one row per prefix and topic), and Redis keeps the same id in the stream's epoch
// marker, <prefix>epoch:{<topic>} ([EpochKey], in the stream's cluster slot, so it is lost
// exactly when the stream is).
//
//   - A dispatcher reads the markers of a batch's topics before it publishes the batch
//     (one pipelined script call per topic, one round trip per batch; a topic it has not matched with PostgreSQL yet costs
//     one more statement, in the batch's transaction), and, whenever it is idle, those of
//     every topic PostgreSQL holds an epoch of ([Dispatcher.CheckStreams]; PostgreSQL's
//     epochs are read again at most once per PollInterval). It never appends to a stream
//     whose marker is absent or is not PostgreSQL's epoch: the batch rolls back unpublished
//     and the topic is settled.
//   - Settling happens under an exclusive PostgreSQL advisory lock that every batch holds
//     shared from its claim to its commit, so the batches that published before a loss
//     have committed and no batch claims rows meanwhile. After taking it the dispatcher
//     reads PostgreSQL's epoch and the marker again, so several dispatchers in several
//     processes settle one at a time and the ones after the first find it settled: one
//     loss is recovered once, and one dispatcher's first start is never another's loss.
//   - No epoch in PostgreSQL: the topic was never dispatched with epochs (a fresh install,
//     an upgrade from a version without them, a new topic). A new epoch is set as the
//     marker (a marker already there is adopted) and recorded in PostgreSQL; nothing is
//     published again, whatever the streams hold. So upgrading republishes nothing: events
//     sent by the previous version and not consumed stay where they were.
//   - PostgreSQL's epoch and a marker absent or different: Redis lost the stream's data
//     (a different marker: Redis came back from a snapshot older than the last recovery).
//     The topic's position moves back to just before its first row created within
//     RecoverWindow (24 h by default) before the recovery (walking back from the position
//     in steps of RecoverBatch rows, until a whole step is older), so those rows are
//     dispatched again; counted in idemscrape_outbox_streams_lost_total and
//     idemscrape_outbox_remarked_total and logged once (level ERROR); then a new epoch is
//     written to PostgreSQL and set as the marker. A crash in between leaves the two
//     different: the next dispatcher moves the position back again, more copies, never
//     fewer. The window counts from a row's creation (there is no per-row sent time): an
//     event that waited longer than RecoverWindow to be dispatched, then was lost, is not
//     published again.
//   - A [Consumer] whose group vanished while it runs (NOGROUP) creates it again at the
//     beginning of the new stream ("0", whatever StartID says), so it reads the entries
//     published again, and any published before it noticed.
//
// The effect for consumers: every event that may have been in the lost stream is
// delivered again, including those the group had already handled before the loss.
// [Consumer.RunTx] recognises them in its PostgreSQL inbox: exactly once in effect, as
// long as RecoverWindow is shorter than the inbox retention. [Consumer.Run] keeps its
// ledger in Redis, in the stream's slot, so it is lost with the stream: every event sent
// within RecoverWindow before the loss that the group had already handled runs its
// handler a second time (at least once; exactly once only for idempotent handlers).
//
//   - A Redis that comes back with part of its data from the current epoch (restarted
//     from an RDB snapshot or AOF taken before the last writes, a replica promoted before
//     it received them) keeps the right marker but lacks the newest entries. PostgreSQL
//     tells: every batch reads the stream's XINFO STREAM entries-added right after its own
//     XADDs (state.lua, in the XADDs' pipeline: no round trip of its own) and records it
//     in the statement that moves the topic's position (outbox_epochs.entries_added,
//     migration 00013, keeping the greatest). Its entries lie within that count whatever other
//     dispatchers appended before, between or after them, and a copy of the stream is a
//     prefix of its history: a copy that lacks an entry of any committed batch has fewer
//     entries added than PostgreSQL recorded, however many dispatchers' batches overlapped
//     (TestPartialLossOverlappingDispatchers). The marker check reads the stream's
//     entries-added with the marker (state.lua, the same round trip). Trims and deletions
//     do not lower entries-added; only a rollback does. A stream with fewer than
//     PostgreSQL recorded (read before Redis, so another dispatcher's batch can not make
//     an intact stream look short) is settled as a loss: the same republish, and the count
//     starts again at 0.
//
// What it cannot see: an event published and consumed before the snapshot is not
// republished (nothing was lost for it), and XDEL of the newest entries by hand is not a
// loss. A copy that comes back while a batch is between its XADDs and its commit, without
// that batch's entries, is missed if batches that checked the stream against an older
// count (claimed before that commit) append at least as many entries to the copy as it
// lacks before any batch checks it against the committed count: a window of a batch's
// commit, which a failover, during which publishes fail, usually outlasts. Likewise after an upgrade, events left unconsumed in a stream under an old key
// name stay there; an operator republishes them, by hand:
//
//	UPDATE outbox_positions p SET xid = o.xid, id = o.id - 1
//	FROM (SELECT xid, id FROM outbox WHERE topic = '<topic>'
//		AND created_at >= '<time of the snapshot, minus a margin>' ORDER BY xid, id LIMIT 1) o
//	WHERE p.topic = '<topic>' AND (o.xid, o.id) <= (p.xid, p.id);
//
// (the dispatchers publish the rows after the position again, RunTx consumers deduplicate
// them, Run consumers whose ledger went back too run them again).
//
// An epoch marker deleted or evicted under running dispatchers counts as a loss (a
// republish, harmless to RunTx consumers): run Redis with maxmemory-policy noeviction, as
// asynq needs anyway. Deleting a topic's outbox_epochs row makes its next dispatch a first
// start (nothing published again); deleting its outbox_positions row publishes every row of
// the topic still in the table again. All dispatchers on one outbox table should use one
// Prefix: epochs are kept per prefix and topic, positions per topic, and which prefix's
// stream a row goes to depends on which dispatcher takes its batch.
//
// # Trimming
//
// Redis 7.0 has neither idempotent XADD nor the ACKED trim option, and plain MAXLEN trimming
// drops entries that a consumer group has not delivered or not acknowledged yet. So the
// dispatcher's default policy, [TrimConsumed], does two things to each topic it publishes
// to, at most once per TrimInterval (a minute by default) per topic and riding on a batch
// that publishes to it, never a round trip per event:
//
//   - It removes what every group has acknowledged ([Trimmer], one round trip after the
//     batch's commit): XTRIM MINID to a floor computed atomically (one Lua script,
//     lua.TrimStream in lua/trim.lua) over every consumer group of the stream, the smallest
//     of each group's oldest pending id and the id right after the group's
//     last-delivered-id.
//   - It caps the stream at MaxLen entries (1,000,000 by default; store/outbox/cap.lua, one
//     more command in the batch's XADD pipeline): a stream found longer loses its oldest
//     entries down to MaxLen, acknowledged or not. The safety valve: a group that stopped
//     reading holds the floor above for ever, and without a cap its stream would grow until
//     Redis, which must run with noeviction, refuses every write — asynq's included.
//
// The bound of the first, alone:
//
//   - every entry that is pending in some group (delivered, not acknowledged) is kept;
//   - every entry that some group has not been delivered yet is kept;
//   - only entries that every group has delivered and acknowledged can be removed; a group
//     with a slow consumer therefore holds the stream's length up, by design;
//   - a stream without any consumer group is never trimmed by it (nobody has read it).
//
// The cap takes precedence: a stream holds at most MaxLen entries after a trim, and between
// two trims grows by what is published to it meanwhile (MaxLen + one TrimInterval of
// events). A group further behind than MaxLen entries loses events: the removed entries
// it had not acknowledged — never delivered to it, or delivered and still pending — are
// counted per group, in the same script that trims, so no group moves in between
// (idemscrape_outbox_stream_cap_lost_total{topic,group}; every entry the cap removes is in
// idemscrape_outbox_stream_capped_total{topic}), and logged at level ERROR naming the topic
// and the groups (counts only, never events): one line when a topic first loses events, then
// one per LossLogInterval (and one when another group starts losing). A group that keeps
// within MaxLen entries of the head loses nothing. Pending entries the cap removed also
// surface in the group's consumers, which report them as lost when they reclaim them. The
// script also keeps Redis's lag of such a group true (Redis 7.0 would go on counting the
// removed entries in it): see cap.lua. Its counts assume that nothing else removes entries
// a group has not read (MAXLEN on another XADD, XDEL).
//
// [TrimNever] turns both off; MaxLen = [NoMaxLen] keeps the first and turns the cap off.
// See docs/OPERATIONS.md (Bounded Redis) for the memory per event and maxmemory.
//
// What the floor cannot protect: a group created later with a start id in the trimmed
// range, or moved back with XGROUP SETID, does not find the entries that were trimmed
// before it existed; and anything else that trims or deletes entries (MAXLEN on another
// XADD, XDEL) bypasses the floor. Entries removed while pending surface in XAUTOCLAIM and
// are reported as lost by the [Consumer].
//
// # Consuming
//
// A [Consumer] reads a stream in a consumer group, runs a handler per event and
// acknowledges (XACK) an entry only after its handler succeeded (or after it recognised the
// entry as a duplicate). A handler error leaves the entry pending; it is delivered again
// when an XAUTOCLAIM (every ReclaimInterval, for entries idle longer than MinIdle) claims it,
// by this consumer or another one in the group. Entries of consumers that died are claimed
// the same way. Entries that were deleted or trimmed while pending are reported as lost,
// loudly: an error log, idemscrape_outbox_lost_total and the OnLost callback.
//
// Two idempotency modes:
//
//   - [Consumer.Run] keeps a ledger in Redis: keys <prefix>ledger:{<topic>}:<group>:<event_key>
//     ([LedgerKey]; the stream's hash tag, so a consumer's keys share one cluster slot). It
//     is checked before the handler and set (SET NX with a TTL, 7 days by default) only
//     after the handler succeeded, so a handler that failed is run again on redelivery. A
//     duplicate whose mark exists is acknowledged and skipped. What it cannot promise: a
//     crash (or a failed SET) between the handler's side effect and the ledger SET runs the
//     handler again on redelivery, and two copies of one event handled at the same moment
//     by two consumers both run it; a mark that expired lets a later replay through; a
//     Redis that lost its data lost the ledger too (see Redis data loss). The effect is at
//     least once; it is exactly once only for handlers that are idempotent.
//   - [Consumer.RunTx] keeps an inbox table in PostgreSQL (outbox_inbox, migration 00002).
//     Each event runs in one transaction that inserts (group, event_key) into the inbox and
//     runs the handler with that transaction; a replay finds the row and is skipped. The
//     handler's writes and the "seen" mark commit or roll back together: the effect is
//     exactly once, as long as the handler's side effect is written through the
//     transaction it is given. Each replay it recognises is added to its inbox row's
//     replays column (migration adding outbox_inbox.replays), so the events deduplicated
//     downstream can be counted from PostgreSQL; on a database without that column it
//     consumes as before and only the metric counts them.
//
// # Maintenance
//
// [Lag] reports rows not dispatched yet older than a threshold (no dispatcher running, or a
// write transaction held open); [PruneSent] deletes dispatched outbox rows (behind their
// topic's position) created longer ago than the retention, oldest first, and
// [InboxPrune] inbox rows, in bounded batches (call until a short batch). [Maintainer] binds the three to a pool for a
// reconciler.
//
// # Failpoints
//
// [DispatcherConfig.AfterPublish] and [ConsumerConfig.BeforeAck] are hooks for tests and
// chaos runs: returning an error from them makes the component behave as if it had
// crashed at that point (the dispatcher rolls back after publishing; the consumer skips
// the XACK after handling). Production configurations leave them nil.
//
// # Metrics
//
// Registered on the Registerer given in the config (a private registry by default, never
// the global one); components sharing a Registerer share the collectors.
//
//	idemscrape_outbox_published_total{topic}      XADDs that succeeded (every copy)
//	idemscrape_outbox_republished_total{topic}    copies whose batch rolled back afterwards
//	idemscrape_outbox_dispatch_lag_seconds        now − created_at at XADD time
//	idemscrape_outbox_streams_lost_total{topic}   streams found to have lost their history
//	idemscrape_outbox_remarked_total{topic}       rows put in front of the position again after a loss
//	idemscrape_outbox_stream_capped_total{topic}  entries the length cap removed
//	idemscrape_outbox_stream_cap_lost_total{topic,group}  of those, entries the group had not acknowledged
//	idemscrape_outbox_stream_length{topic}        XLEN, read with each batch and every PollInterval
//	idemscrape_outbox_stream_max_length{topic}    the length cap (MaxLen)
//	idemscrape_outbox_horizon_held_by_prepared{database}  transactions prepared there longer than PreparedAlertAge ago
//	idemscrape_outbox_deduplicated_total{group}   duplicates acknowledged without the handler
//	idemscrape_outbox_claimed_total{group}        entries reclaimed with XAUTOCLAIM
//	idemscrape_outbox_lost_total{group}           pending entries deleted or trimmed away
//	idemscrape_outbox_malformed_total{group}      entries that are not outbox events
package outbox
