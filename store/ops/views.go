package ops

import (
	"fmt"
	"strings"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
)

// WindowBudgetState is one window's money budget against its spend, for a job page.
type WindowBudgetState struct {
	Budget store.Cost // the kind's budget per window
	Spent  store.Cost // what the window's recorded attempts cost, in the budget's currency
}

// Exhausted reports whether nothing is left: no new attempt of the window starts.
func (w WindowBudgetState) Exhausted() bool { return w.Spent.Micros >= w.Budget.Micros }

// Deferral describes what the window budget means for a job in state, "" when nothing:
// a runnable job of a spent window is deferred (handlers.WindowDefer hands its deliveries
// back, uncounted, until the budget is raised); a failed one failed for it if its last
// category is budget_exceeded.
func (w WindowBudgetState) Deferral(state tasks.JobState, lastCategory string) string {
	if !w.Exhausted() {
		return ""
	}
	figures := fmt.Sprintf("(%s of %s)", w.Spent, w.Budget)
	switch {
	case state == tasks.StatePending || state == tasks.StateRetryable:
		return "deferred: window budget spent " + figures
	case state == tasks.StateFailed && lastCategory == string(tasks.CategoryBudgetExceeded):
		return "failed: window budget spent " + figures + "; re-queue once the budget is raised"
	}
	return ""
}

// QuarantineWhy says, for an operator, what set a quarantined staging aside, from its
// reason (the category of the failure that cut the unit, then its detail): not every
// quarantine is a lost session.
func QuarantineWhy(reason string) string {
	category, _, _ := strings.Cut(reason, ":")
	switch tasks.Category(strings.TrimSpace(category)) {
	case tasks.CategorySessionLost, tasks.CategoryExitUnavailable, tasks.CategoryTimeout:
		return "the session was cut: the unit replays from step 1 on another session, never the lost one (unless its restarts ran out or an unsafe step had run); this half is never merged"
	case tasks.CategoryBudgetExceeded:
		return "stopped by a budget (the job's bytes or money, or its window's), not a lost session: not replayed"
	case tasks.CategoryValidation:
		return "the staged data failed the unit's validation"
	}
	return "the attempt failed with data staged: not replayed"
}
