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
// (SELECT … FOR UPDATE SKIP LOCKED, oldest first), appends them with one pipelined round of
// XADD to the stream <prefix>stream:<topic> (see [StreamKey]), and only then marks them sent
// and commits. Any number of dispatchers may run at once, in one process or many: SKIP LOCKED
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
// # Trimming
//
// Redis 7.0 has neither idempotent XADD nor the ACKED trim option, and plain MAXLEN trimming
// drops entries that a consumer group has not delivered or not acknowledged yet. So the
// dispatcher does not trim by default ([TrimNever]). A [Trimmer] (or [TrimConsumed] in
// [DispatcherConfig]) trims with XTRIM MINID to a floor computed atomically (one Lua script)
// over every consumer group of the stream: the smallest of each group's oldest pending id
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
//   - [Consumer.Run] keeps a ledger in Redis: key <prefix>ledger:{<group>}:<event_key>. It
//     is checked before the handler and set (SET NX with a TTL, 7 days by default) only
//     after the handler succeeded, so a handler that failed is run again on redelivery. A
//     duplicate whose mark exists is acknowledged and skipped. What it cannot promise: a
//     crash (or a failed SET) between the handler's side effect and the ledger SET runs the
//     handler again on redelivery, and two copies of one event handled at the same moment
//     by two consumers both run it; a mark that expired lets a later replay through. The
//     effect is at least once; it is exactly once only for handlers that are idempotent.
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
//	idemscrape_outbox_deduplicated_total{group}   duplicates acknowledged without the handler
//	idemscrape_outbox_claimed_total{group}        entries reclaimed with XAUTOCLAIM
//	idemscrape_outbox_lost_total{group}           pending entries deleted or trimmed away
//	idemscrape_outbox_malformed_total{group}      entries that are not outbox events
package outbox
