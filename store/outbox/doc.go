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
// A [Dispatcher] claims up to BatchSize unsent rows in one transaction
// (SELECT … FOR UPDATE SKIP LOCKED, oldest first), checks that the epoch marker of each
// topic's stream is there (one pipelined GET, see Redis data loss below), appends them with
// one pipelined round of XADD to the stream <prefix>stream:{<topic>} (see [StreamKey]), and
// only then marks them sent and commits. Any number of dispatchers may run at once, in one process or many: SKIP LOCKED
// hands each a disjoint batch. Guarantees:
//
//   - A row is marked sent only after its XADD succeeded. If Redis is down, a publish is
//     retried a bounded number of times with backoff and jitter, then the transaction rolls
//     back and the rows are picked up again later.
//   - A crash, a failed mark, a failed commit or the AfterPublish failpoint between XADD and
//     commit republishes the batch: the stream may hold an event more than once (with the
//     same event_key and outbox_id). Consumers recognise the replay by event_key.
//   - There is no order across batches when several dispatchers run: consumers must not
//     rely on stream order between events.
//
// # Redis data loss
//
// A row is marked sent once its XADD succeeded; if Redis then loses its data (restarted
// without persistence, FLUSHALL, a cluster node replaced empty), the entries not yet
// consumed are gone. The dispatchers find such a loss and publish those events again:
//
//   - Every stream has an epoch marker, <prefix>epoch:{<topic>} ([EpochKey], in the
//     stream's cluster slot, so it is lost exactly when the stream is). A dispatcher reads
//     the markers of a batch's topics before it publishes the batch, and of every topic it
//     watches whenever it is idle ([Dispatcher.CheckStreams]; the topics it published to
//     since it started and those sent within RecoverWindow when it started). It never
//     appends to a stream whose marker is absent.
//   - A marker absent means a possible loss. The dispatcher then takes an exclusive
//     PostgreSQL advisory lock that every batch holds shared from its claim to its commit,
//     so the batches that published before the loss have committed and no batch claims
//     rows meanwhile; several dispatchers in several processes recover one at a time, and
//     the ones after the first find the marker back and do nothing.
//   - The stream lost its history if this dispatcher had seen the marker and saw it
//     vanish, or if the stream has recorded fewer entries ever added (XINFO STREAM
//     entries-added; trimming and XDEL never lower it) than the outbox holds rows of the
//     topic marked sent: every sent row was appended before it was marked. So a stream
//     trimmed empty, a second dispatcher starting, a consumer group recreated on an empty
//     stream or the first start on an intact stream (an upgrade from a version without
//     markers) re-mark nothing.
//   - On a loss, the rows of the topic sent within RecoverWindow (24 h by default) before
//     the recovery are marked unsent again in batches of RecoverBatch, counted in
//     idemscrape_outbox_streams_lost_total and idemscrape_outbox_remarked_total and logged
//     once (level ERROR); then the marker is created anew and the rows are dispatched as
//     usual. A crash in between re-marks again later: more copies, never fewer.
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
// What it cannot see: a Redis that comes back with part of its data (restarted from an
// older RDB snapshot or AOF, a replica promoted before it received the last writes) still
// has the marker, so the entries appended after the snapshot and not yet consumed are not
// republished. Use appendonly with appendfsync always, or accept that window. An epoch
// marker deleted or evicted by hand under running dispatchers counts as a loss (a
// republish, harmless to RunTx consumers): run Redis with maxmemory-policy noeviction, as
// asynq needs anyway. All dispatchers on one outbox table must use one Prefix (a row sent
// under another prefix looks missing from this one's streams).
//
// # Trimming
//
// Redis 7.0 has neither idempotent XADD nor the ACKED trim option, and plain MAXLEN trimming
// drops entries that a consumer group has not delivered or not acknowledged yet. So the
// dispatcher does not trim by default ([TrimNever]). A [Trimmer] (or [TrimConsumed] in
// [DispatcherConfig]) trims with XTRIM MINID to a floor computed atomically (one Lua
// script, lua.TrimStream in lua/trim.lua) over every consumer group of the stream: the smallest of each group's oldest pending id
// and the id right after the group's last-delivered-id. The bound is:
//
//   - every entry that is pending in some group (delivered, not acknowledged) is kept;
//   - every entry that some group has not been delivered yet is kept;
//   - only entries that every group has delivered and acknowledged can be removed; a group
//     with a slow consumer therefore holds the stream's length up, by design;
//   - a stream without any consumer group is never trimmed (nobody has read it).
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
// [Lag] reports unsent rows older than a threshold (no dispatcher running); [PruneSent]
// and [InboxPrune] delete sent outbox rows and inbox rows older than their retention in
// bounded batches (call until a short batch). [Maintainer] binds the three to a pool for a
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
//	idemscrape_outbox_remarked_total{topic}       sent rows marked unsent again after a loss
//	idemscrape_outbox_deduplicated_total{group}   duplicates acknowledged without the handler
//	idemscrape_outbox_claimed_total{group}        entries reclaimed with XAUTOCLAIM
//	idemscrape_outbox_lost_total{group}           pending entries deleted or trimmed away
//	idemscrape_outbox_malformed_total{group}      entries that are not outbox events
package outbox
