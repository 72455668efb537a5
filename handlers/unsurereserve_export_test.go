package handlers

// ObserveWindowBytes records bytes as a measured attempt of the kind's window estimate
// (WindowBudget), as a finished attempt of it would.
func ObserveWindowBytes(r *Registry, kindName string, bytes int64) {
	r.kinds[kindName].window.samples.observe(bytes)
}
