package handlers

import (
	"bytes"
	"encoding/json"
	"io"
	"log/slog"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// TestLeaseLengthsSortedWindow: the incrementally sorted window gives, after every
// observation (the window wrapping many times, with repeated values), the length the
// window copied and sorted gives.
func TestLeaseLengthsSortedWindow(t *testing.T) {
	cfg := LeaseLengthConfig{Default: time.Minute, Min: time.Second, Max: time.Hour, MinSamples: 5, Window: 37}
	l, err := NewLeaseLengths(&cfg)
	if err != nil {
		t.Fatal(err)
	}
	cfg = l.cfg // with defaults
	rng := rand.New(rand.NewPCG(3, 4))
	var window []time.Duration
	for i := range 2000 {
		d := time.Duration(1+rng.IntN(50)) * 500 * time.Millisecond // many duplicates
		l.Observe("k", d)
		window = append(window, d)
		if len(window) > cfg.Window {
			window = window[1:]
		}
		want := cfg.Default
		if len(window) >= cfg.MinSamples {
			sorted := slices.Sorted(slices.Values(window))
			idx := max(0, min(int(float64(len(sorted))*cfg.Percentile+0.999999)-1, len(sorted)-1))
			want = max(cfg.Min, min(time.Duration(float64(sorted[idx])*cfg.Margin), cfg.Max))
		}
		if got := l.For("k"); got != want {
			t.Fatalf("observation %d: For = %v, want %v", i, got, want)
		}
	}
}

// TestDefaultEventBytes: the default event's bytes are those of the map it replaced.
func TestDefaultEventBytes(t *testing.T) {
	for _, data := range []json.RawMessage{json.RawMessage(`{"len": 8192, "name":"<a&b>"}`), nil, json.RawMessage(`[1,2]`)} {
		want, err := json.Marshal(map[string]any{"job_key": "page:x&<", "observation_key": "obs\u2028", "kind": "page",
			"parser_version": 3, "data": data})
		if err != nil {
			t.Fatal(err)
		}
		got, err := eventPayload(nil, defaultEvent{JobKey: "page:x&<", ObservationKey: "obs\u2028", Kind: "page", ParserVersion: 3, Data: data})
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("event\n got %s\nwant %s", got, want)
		}
	}
	custom, err := eventPayload(map[string]int{"x": 1}, defaultEvent{JobKey: "ignored"})
	if err != nil || string(custom) != `{"x":1}` {
		t.Fatalf("parser's event: %s, %v", custom, err)
	}
}

// TestJobLoggerOutputAsWith: the lazy job logger writes what Logger.With wrote: the job's
// attributes first, in order, outside groups opened later, under groups opened before.
func TestJobLoggerOutputAsWith(t *testing.T) {
	opts := &slog.HandlerOptions{Level: slog.LevelDebug, ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
		if a.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return a
	}}
	for _, format := range []string{"text", "json"} {
		for _, grouped := range []bool{false, true} {
			var a, b bytes.Buffer
			newH := func(w *bytes.Buffer) slog.Handler {
				if format == "json" {
					return slog.NewJSONHandler(w, opts)
				}
				return slog.NewTextHandler(w, opts)
			}
			base1, base2 := slog.New(newH(&a)), slog.New(newH(&b))
			if grouped {
				base1, base2 = base1.WithGroup("svc").With("v", 1), base2.WithGroup("svc").With("v", 1)
			}
			w1 := base1.With("job", "k1", "kind", "page").With("attempt", 2, "token", int64(7), "endpoint", "gw:1")
			w2 := jobLogger(jobLogger(base2, slog.String("job", "k1"), slog.String("kind", "page")),
				slog.Int("attempt", 2), slog.Int64("token", 7), slog.String("endpoint", "gw:1"))
			for _, l := range []*slog.Logger{w1, w2} {
				l.Info("job complete", "bytes", 10)
				l.With("session", "s1", "a", 1, "b", 2, "c", 3, "d", 4).Warn("more attrs than the array holds", "x", true)
				l.WithGroup("step").Debug("grouped", "n", 1)
				l.With("s", 1).WithGroup("g").With("t", 2).Error("nested", "e", "boom")
			}
			if a.String() != b.String() {
				t.Fatalf("%s grouped=%v:\nWith:\n%s\njobLogger:\n%s", format, grouped, a.String(), b.String())
			}
		}
	}
}

// BenchmarkRunnerParts measures the runner's per-attempt bookkeeping, each part in the
// form it had before (a reference copy here) and now.
func BenchmarkRunnerParts(b *testing.B) {
	b.Run("LeaseLength/ObserveFor/CloneSort", func(b *testing.B) { // before: the window copied and sorted per For
		window := make([]time.Duration, 0, DefaultLeaseWindow)
		next := 0
		b.ReportAllocs()
		for i := 0; b.Loop(); i++ {
			d := time.Duration(1+i%977) * time.Millisecond
			if len(window) < DefaultLeaseWindow {
				window = append(window, d)
			} else {
				window[next] = d
				next = (next + 1) % DefaultLeaseWindow
			}
			sorted := slices.Clone(window)
			slices.Sort(sorted)
			_ = sorted[int(float64(len(sorted))*DefaultLeasePercentile+0.999999)-1]
		}
	})
	b.Run("LeaseLength/ObserveFor/Sorted", func(b *testing.B) { // now
		l, _ := NewLeaseLengths(nil)
		b.ReportAllocs()
		for i := 0; b.Loop(); i++ {
			l.Observe("k", time.Duration(1+i%977)*time.Millisecond)
			_ = l.For("k")
		}
	})
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	b.Run("Logger/With", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			log := logger.With("job", "page:p-1:US:2026-04-23:v1", "kind", "page")
			log = log.With("attempt", 1, "token", int64(7), "endpoint", "127.0.0.1:8080")
			log.Info("job complete", "session", "s1", "bytes", 8192, "exit", "exit not verified")
		}
	})
	b.Run("Logger/Lazy", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			log := jobLogger(logger, slog.String("job", "page:p-1:US:2026-04-23:v1"), slog.String("kind", "page"))
			log = jobLogger(log, slog.Int("attempt", 1), slog.Int64("token", 7), slog.String("endpoint", "127.0.0.1:8080"))
			log.Info("job complete", "session", "s1", "bytes", 8192, "exit", "exit not verified")
		}
	})
	data := json.RawMessage(`{"len":8192}`)
	b.Run("Event/Map", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_, _ = json.Marshal(map[string]any{"job_key": "page:p-1:US:2026-04-23:v1", "observation_key": "page:p-1:US:2026-04-23:v1",
				"kind": "page", "parser_version": 1, "data": data})
		}
	})
	b.Run("Event/Struct", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_, _ = eventPayload(nil, defaultEvent{JobKey: "page:p-1:US:2026-04-23:v1", ObservationKey: "page:p-1:US:2026-04-23:v1",
				Kind: "page", ParserVersion: 1, Data: data})
		}
	})
}
