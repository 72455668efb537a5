package store

// GroupHooks lets store_test observe and steer a GroupCommitter (both kinds).
type GroupHooks struct {
	Queued  func()               // a request entered the queue
	Collect func()               // a batch is about to be collected (block to pause)
	Before  func([]string) error // a statement is about to be sent; an error replaces it
	After   func([]string) error // a statement succeeded; an error replaces its outcome
}

// SetGroupHooks installs h; call it before the committer is used.
func SetGroupHooks(g *GroupCommitter, h GroupHooks) {
	gh := &groupHooks{queued: h.Queued, collect: h.Collect, before: h.Before, after: h.After}
	g.commits.hooks = gh
	g.starts.hooks = gh
}

// StartSQL is the fenced start statement (lockSkip) and StartableStates its $7.
var StartSQL, StartableStates = startSQLs[lockSkip], startableStates

// CommitSQLs are the fenced commit statements ([lock][notify]).
var CommitSQLs = commitSQLs
