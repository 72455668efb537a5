package scheduler

import "time"

// LoopFires returns what the loop of template name ticks from its first fire after from
// through to, the clock reading each fire's instant: the instants and their windows.
func LoopFires(s *Scheduler, name string, from, to time.Time) (ats []time.Time, windows []string) {
	t := s.template(name)
	for f := t.sched.nextFire(from, nil); !f.IsZero() && !f.At.After(to); f = t.sched.following(f, f.At) {
		ats, windows = append(ats, f.At), append(windows, f.Window)
	}
	return ats, windows
}
