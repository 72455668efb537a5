package outbox

// SetBeforeSettle makes d call fn after a batch rolled back because its topics' epochs were
// unsettled, before d settles them. Tests use it to make two dispatchers settle at once.
func SetBeforeSettle(d *Dispatcher, fn func(topics []string)) { d.beforeSettle = fn }

// SetCapStep sets the most entries one run of the cap script removes (defaultCapStep), so
// tests can make a cap catch up in several calls.
func SetCapStep(d *Dispatcher, n int) { d.capStep = n }
