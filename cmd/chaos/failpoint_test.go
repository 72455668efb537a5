package main

import (
	"log/slog"
	"testing"

	"github.com/stretchr/testify/assert"
)

// TestFailpointLines reads the lines cmd/worker writes at a failpoint (cmd/worker's
// failpoints.go), including an error text full of words that look like fields.
func TestFailpointLines(t *testing.T) {
	h := &harness{fpKills: map[string]int{}, fpKeys: map[string][]string{}, log: slog.New(slog.DiscardHandler)}
	fl := h.recordFailpoint(`FAILPOINT name=before_commit pid=27475 key=catalog:sku-34:US:2026-12-02:v1 token=7`)
	assert.Equal(t, failpointFields{name: fpBeforeCommit, detail: "catalog:sku-34:US:2026-12-02:v1", token: 7}, fl)
	h.stale = append(h.stale, &staleCommit{Key: fl.detail, Token: fl.token})

	errText := `"Commit \"catalog:sku-34:US:2026-12-02:v1\": store: stale fencing token (state retryable, fence 8, token 7) key=x token=9"`
	sent := h.recordFailpoint(`FAILPOINT name=before_commit_sent pid=27475 key=catalog:sku-34:US:2026-12-02:v1 token=7 outcome=refused took=12ms ` +
		`err=` + errText)
	assert.Equal(t, failpointFields{name: fpBeforeCommit + "_sent", detail: "catalog:sku-34:US:2026-12-02:v1", token: 7, outcome: "refused",
		err: errText, diag: "took=12ms"}, sent, "the fields inside the error text are not read as fields")
	h.staleSent(sent)
	assert.Equal(t, "refused", h.stale[0].Outcome)
	assert.Equal(t, errText+" (took=12ms)", h.stale[0].Err)
	assert.Equal(t, map[string]int{fpBeforeCommit: 1}, h.fpKills, "the _sent line is not a second firing")
}
