package outbox

// SetBeforeSettle makes d call fn after a batch rolled back because its topics' epochs were
// unsettled, before d settles them. Tests use it to make two dispatchers settle at once.
func SetBeforeSettle(d *Dispatcher, fn func(topics []string)) { d.beforeSettle = fn }
