package scheduler

import "github.com/idemscrape/idemscrape/store/outbox"

// outbox.Maintainer (store/outbox's Lag, PruneSent and InboxPrune on one pool) is the
// OutboxMaintainer on PostgreSQL.
var _ OutboxMaintainer = (*outbox.Maintainer)(nil)
