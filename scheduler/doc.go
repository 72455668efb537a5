// Package scheduler runs idemscrape's periodic job templates and the reconciler.
//
// # Templates and windows
//
// A Template (YAML, see examples/scheduler.yaml and File) names a cron expression and
// time zone, a job kind, sources (inline URLs or source ids, or a file of lines read again
// on every tick), countries, a parser version, a scope and a window rule. Every tick
// expands sources × countries into tasks.Specs whose Window is computed by the rule from
// the tick's scheduled instant in the template's zone (daily "2026-04-23", hourly
// "2026-04-23T14", weekly ISO "2026-W17", monthly "2026-04"; see WindowRule for DST), and
// enqueues them with tasks.Enqueuer.EnqueueMany in batches. Because the window is part of
// the job key, a tick fired twice, by two schedulers, or again after a restart enqueues
// nothing new: PostgreSQL's primary key and asynq's TaskID both deduplicate. asynq's own
// Scheduler is not used (it enqueues one TaskID per tick and duplicates across instances).
//
// In the steady state (every job of the window already has its task) a batch costs one
// pipelined Redis round trip and no statement: specs whose asynq task exists are skipped
// before EnqueueMany.
//
// On start, a template with catchup: last (the default) runs the tick of its most recent
// scheduled time before now once, so a window missed while no scheduler ran is enqueued
// (a no-op when it was not missed). catchup: none waits for the next tick.
//
// # Reconciler
//
// Reconciler sweeps, in keyset-paged batches, what a lost Redis or a dead worker leaves
// behind, and is safe to run in any number of processes at once: running jobs whose attempt
// is older than the kind's longest lease and whose lease nobody holds are moved back to
// retryable under a lease the reconciler claims itself (fenced: a live worker holding its
// lease is never touched, a stale one is fenced out); pending and retryable jobs whose
// asynq task is missing or archived are enqueued again; outbox lag is reported; sent outbox
// rows, inbox rows, saved inputs, terminal jobs, quarantine and schedule windows past their
// retention are pruned in bounded batches. See Reconciler for the guarantees.
//
// Queues: a kind's asynq queue is kinds.<kind>.queue in the configuration, defaulting to
// the kind's name (File.QueueFor), the same default as cmd/worker.
package scheduler
