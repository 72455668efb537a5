package outbox

// SetBeforeSettle makes d call fn after a batch rolled back because its topics' epochs were
// unsettled, before d settles them. Tests use it to make two dispatchers settle at once.
func SetBeforeSettle(d *Dispatcher, fn func(topics []string)) { d.beforeSettle = fn }

// SetCapStep sets the most entries one run of the cap script removes (defaultCapStep), so
// tests can make a cap catch up in several calls.
func SetCapStep(d *Dispatcher, n int) { d.capStep = n }

// SetBeforePublish makes d call fn in each batch after the batch's streams were checked
// (their state read) and before anything is published. Tests use it to make batches of
// several dispatchers overlap.
func SetBeforePublish(d *Dispatcher, fn func(topics []string)) { d.beforePublish = fn }
