package handlers

import (
	"context"
	"log/slog"

	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
)

// attemptMoney is one attempt's money, from its reservation to its settlement: the price
// of the provider it runs on, the job's own bandwidth and money budgets, and, for a kind
// with a window money budget, the window's reservation (window.go, lua.WindowBudgets) with
// its top-ups. The runner meets money only through it (Registry.process):
//
//	reserve → reserved (recorded by the attempt's start) → byteCap (the run's cap and its
//	top-up) → cost (the attempt's charge) → settle
//
// A reserve that fails holds nothing; every other attempt is settled, whatever its
// outcome, once its record is written.
type attemptMoney struct {
	r    *Registry
	k    *kind
	job  tasks.Payload
	prov *sessions.Provider
	log  *slog.Logger
	// hold is the window reservation; nil for a kind without a window budget.
	hold *windowHold
	// spent: the window's budget is spent (WindowFail): the attempt fails without fetching.
	spent *sessions.FetchError
}

// reserve is step 0b: what the attempt may spend, reserved where a window budget needs it
// (reserveWindow). It returns an error to hand asynq as it is — a wait for the window's
// money, a deferral, Redis or PostgreSQL unavailable — and then holds nothing.
func (r *Registry) reserve(ctx context.Context, k *kind, job tasks.Payload, slot *providerSlot, owner string, log *slog.Logger) (*attemptMoney, error) {
	hold, spent, err := r.reserveWindow(ctx, k, job, slot, owner, log)
	if err != nil {
		return nil, err
	}
	return &attemptMoney{r: r, k: k, job: job, prov: slot.prov, log: log, hold: hold, spent: spent}, nil
}

// reserved is what the attempt's start records as reserved (a killed attempt's lost row
// carries it): zero without a window budget.
func (m *attemptMoney) reserved() store.Cost { return m.hold.reserved() }

// startReused is for an attempt whose start reused an earlier delivery's owner
// (acquired.reusedOwner): if that delivery's start landed unseen, the store recognised it
// as this start and wrote nothing, so the job's row records that delivery's reservation,
// not this one's — and a worker killed now would be charged this one in Redis when it
// lapses, the earlier one on its lost row in PostgreSQL. It raises the row's reservation
// to this one's (store.PG.JobAttemptReserve, which only raises): one statement, and only
// in this rare case. An earlier reservation above this one stays: a lost attempt is then
// charged more in PostgreSQL than in Redis — the safe direction, since a total restored
// from PostgreSQL stops the window early, never late. Nothing without a window budget.
func (m *attemptMoney) startReused(ctx context.Context, key string, token int64) {
	if m == nil || m.hold == nil {
		return
	}
	if _, err := m.r.cfg.Store.JobAttemptReserve(ctx, key, token, m.hold.reserved()); err != nil {
		m.log.WarnContext(ctx, "window reservation not recorded on an attempt started under an earlier delivery's owner; a lost attempt may be charged less in PostgreSQL than in Redis",
			"window", m.hold.window, "reserved", m.hold.reserved().String(), "err", err)
	}
}

// byteCap is the run's byte cap (sessions.RunConfig.MaxBytes), what it stands for
// (BudgetNote) and its top-up (MoreBytes): what is left of the job's bandwidth and money
// budgets after bytesSoFar, lowered to what the window reservation buys, which is topped
// up as the attempt reaches it (windowByteCap). token is the attempt's fence.
func (m *attemptMoney) byteCap(bytesSoFar, token int64) (int64, string, func(context.Context, int64) (int64, string)) {
	maxBytes, note := m.k.retry.attemptByteCap(m.prov.Price(), m.job.Spec.Country, bytesSoFar)
	if m.hold == nil {
		return maxBytes, note, nil
	}
	return m.r.windowByteCap(m.k, m.hold, m.job, token, maxBytes, note, m.log)
}

// cost is what the attempt's bytes are charged (attemptCost): recorded with its outcome,
// and what its settlement replaces the reservation by.
func (m *attemptMoney) cost(bytes int64) store.Cost {
	return m.r.attemptCost(m.prov, m.k, m.job, bytes)
}

// jobCost is what the job's bytes so far cost at the attempt's price: the job's money
// budget is held to it.
func (m *attemptMoney) jobCost(bytes int64) int64 {
	return m.prov.Price().Cost(bytes, m.job.Spec.Country)
}

// stoppedByWindow: the window's budget, not the job's own, stopped the attempt (its
// top-up found the window spent).
func (m *attemptMoney) stoppedByWindow() bool {
	return m != nil && m.hold != nil && m.hold.capped
}

// topUpErr is why a top-up could not be asked, nil if none failed.
func (m *attemptMoney) topUpErr() error {
	if m == nil || m.hold == nil {
		return nil
	}
	return m.hold.topUpErr
}

// settle is the last step: the window reservation is replaced by w's cost once w's record
// is written (settleWindow). Nothing to do without a window budget.
func (m *attemptMoney) settle(ctx context.Context, w *workResult) {
	if m == nil {
		return
	}
	m.r.settleWindow(ctx, m.k, m.hold, w, m.log)
}
