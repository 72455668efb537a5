// Package reparse runs parsers again over saved inputs, with no network: a batch tool for
// parser fixes and new parser versions (`idemscrape reparse`, or a team's own binary).
//
// A worker that keeps its inputs (handlers.WithSavedInputs) saves the staged data each
// attempt parsed (package store/inputs). Run selects jobs by kind, parser version, window,
// time range, failure category, state or key, parses each job's latest saved input with
// the parser version asked for, and compares the record field by field with the job's
// current one (DiffRecords). A dry run stops there; otherwise each record is committed
// exactly as a worker's attempt would commit it:
//
//   - through the same fenced commit and outbox (store.PG, batched by a
//     store.GroupCommitter), with the event payload and event key the runner writes
//     (handlers.EventPayload, handlers.EventKey): a consumer reads a reparsed
//     observation's event as it reads any other;
//   - under the same leases (package lua, the workers' key prefix,
//     handlers.DefaultKeyPrefix by default): a job a worker holds is left alone, and a
//     worker that comes later finds the job complete;
//   - with the parsers the worker has: a ParserSource, which *handlers.Registry is (a
//     team's own binary passes the registry its worker builds) and *handlers.Parsers is
//     (built by hand, for a tool with no proxy configuration); a parser's error gets the
//     runner's failure category (handlers.ParserFailure).
//
// Package handlers runs jobs as asynq handlers; this package runs no handler and needs no
// asynq server. It depends on handlers, never the reverse. Flags registers the
// command-line flags of a reparse on a flag.FlagSet and turns them into Options.
package reparse
