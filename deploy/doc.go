// Package deploy holds no code: it is the home of the monitoring files a team adopts as
// they are, and of the tests that keep them true to the code.
//
//	prometheus/alerts.yml       alerting rules (group idemscrape); each links its runbook
//	                            in docs/OPERATIONS.md
//	prometheus/alerts_test.yml  promtool unit tests: every alert fires on synthetic series,
//	                            and stays quiet where it must
//	grafana/idemscrape.json     the Grafana dashboard (import it, or provision the file)
//
// The tests fail when a rule or a panel names a metric or a label that the components do
// not register (they build the real handlers registry, scheduler, reconciler and outbox
// dispatcher and consumer, against PostgreSQL and Redis), when promtool rejects a rule or a
// dashboard query, when an alert has no firing test, or when a runbook link has no section.
// They need promtool: $IDEMSCRAPE_PROMTOOL, or promtool on PATH (`.ci/run --test-deps`
// installs it).
package deploy
