package main

import (
	"fmt"
	"io"
	"runtime"
	"slices"
	"text/tabwriter"
)

// tableRow is one (mode, concurrency) line: the runs of each side, pair by pair.
type tableRow struct {
	mode       string
	conc       int
	ours, peer []runResult
}

// modeTitles name the modes in the table.
var modeTitles = map[string]string{
	"b1":        "B1 e2e, proxy, new session/job",
	"b1robots":  "B1 extra: peer robots.txt/job",
	"direct":    "B1 vs direct keep-alive peer",
	"proto":     "B1 protocol only (no fetch)",
	"river":     "B1 vs River + JobCompleteTx",
	"riverfast": "B1 vs River, fastest poll",
	"b3":        "B3 fenced commit vs INSERT",
	"b3g":       "B3 grouped commit vs INSERT",
	"b5":        "B5 EnqueueMany dup vs fresh",
	"b2":        "B2 lease vs SET NX PX + DEL",
	"b4":        "B4 dispatch vs raw XADD",
	"b6":        "B6 enqueue ours vs bare asynq",
	"b7":        "B7 bound fetch vs colly",
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func col(rs []runResult, f func(runResult) float64) []float64 {
	out := make([]float64, len(rs))
	for i, r := range rs {
		out[i] = f(r)
	}
	return out
}

// printTable prints medians over the pairs, the ratio of the medians (ours/peer) and the
// min–max of the per-pair ratios, for throughput, then the costs per job.
func printTable(out io.Writer, rows []tableRow) {
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "mode\tc\tours jobs/s\tpeer jobs/s\tratio\tspread\tCPU µs/job ours\tpeer\tratio\tRedis cmds/job ours\tpeer\tRedis RT/job ours\tpeer\tRedis CPU µs/job ours\tpeer\tPG RT/job ours\tpeer\tPG CPU µs/job ours\tpeer\t")
	for _, r := range rows {
		tput := func(x runResult) float64 { return x.JobsPerSec }
		o, p := median(col(r.ours, tput)), median(col(r.peer, tput))
		ratios := make([]float64, len(r.ours))
		for i := range r.ours {
			ratios[i] = r.ours[i].JobsPerSec / r.peer[i].JobsPerSec
		}
		cpuO := median(col(r.ours, func(x runResult) float64 { return x.CPUPerJobUS }))
		cpuP := median(col(r.peer, func(x runResult) float64 { return x.CPUPerJobUS }))
		c := fmt.Sprint(r.conc)
		if r.conc == 0 {
			c = "-"
		}
		fmt.Fprintf(w, "%s\t%s\t%.0f\t%.0f\t%.2f×\t%.2f–%.2f\t%.0f\t%.0f\t%.2f×\t%.1f\t%.1f\t%.1f\t%.1f\t%.0f\t%.0f\t%.2f\t%.2f\t%.0f\t%.0f\t\n",
			modeTitles[r.mode], c, o, p, o/p, slices.Min(ratios), slices.Max(ratios), cpuO, cpuP, cpuO/cpuP,
			median(col(r.ours, func(x runResult) float64 { return x.RedisCmds })), median(col(r.peer, func(x runResult) float64 { return x.RedisCmds })),
			median(col(r.ours, func(x runResult) float64 { return x.RedisRT })), median(col(r.peer, func(x runResult) float64 { return x.RedisRT })),
			median(col(r.ours, func(x runResult) float64 { return x.RedisCPUUS })), median(col(r.peer, func(x runResult) float64 { return x.RedisCPUUS })),
			median(col(r.ours, func(x runResult) float64 { return x.PGRT })), median(col(r.peer, func(x runResult) float64 { return x.PGRT })),
			median(col(r.ours, func(x runResult) float64 { return x.PGCPUUS })), median(col(r.peer, func(x runResult) float64 { return x.PGCPUUS })))
	}
	_ = w.Flush()
}

func numCPU() int { return runtime.NumCPU() }

// printBoxTable prints the whole-box CPU per job of the end-to-end modes (boxcpu.go):
// medians of the sum, its ratio and per-pair spread, then the medians of each part.
func printBoxTable(out io.Writer, rows []tableRow) {
	var box []tableRow
	for _, r := range rows {
		if slices.Contains(boxModes, r.mode) {
			box = append(box, r)
		}
	}
	if len(box) == 0 {
		return
	}
	fmt.Fprintln(out, "Whole-box CPU µs/job (worker + run's PG backends + its redis-server + proxy & site; medians):")
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "mode\tc\tours\tpeer\tratio\tspread\tworker ours\tpeer\tPG backends ours\tpeer\tredis-server ours\tpeer\tproxy+site ours\tpeer\t")
	for _, r := range box {
		total := func(x runResult) float64 { return x.BoxCPUUS }
		o, p := median(col(r.ours, total)), median(col(r.peer, total))
		ratios := make([]float64, len(r.ours))
		for i := range r.ours {
			ratios[i] = r.ours[i].BoxCPUUS / r.peer[i].BoxCPUUS
		}
		part := func(f func(runResult) float64) string {
			return fmt.Sprintf("%.0f\t%.0f", median(col(r.ours, f)), median(col(r.peer, f)))
		}
		fmt.Fprintf(w, "%s\t%d\t%.0f\t%.0f\t%.2f×\t%.2f–%.2f\t%s\t%s\t%s\t%s\t\n", modeTitles[r.mode], r.conc, o, p, o/p, slices.Min(ratios), slices.Max(ratios),
			part(func(x runResult) float64 { return x.BoxWorkerUS }), part(func(x runResult) float64 { return x.BoxPGUS }),
			part(func(x runResult) float64 { return x.BoxRedisUS }), part(func(x runResult) float64 { return x.BoxProxySiteUS }))
	}
	_ = w.Flush()
}
