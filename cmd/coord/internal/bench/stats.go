package bench

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// benchRow is one row of the table.
type benchRow struct {
	scenario     string
	coord, plain string
	ratio        string
	limit        string
}

func writeBenchTable(w io.Writer, rows []benchRow) {
	fmt.Fprintln(w, "| scenario | coord | plain etcd | ratio | limit |")
	fmt.Fprintln(w, "| --- | --- | --- | --- | --- |")
	for _, r := range rows {
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s |\n", cell(r.scenario), cell(r.coord), cell(r.plain), cell(r.ratio), cell(r.limit))
	}
}

func benchSortDurations(d []time.Duration) { slices.Sort(d) }

// benchPct returns the p-th percentile of samples by the nearest-rank method:
// the smallest sample at or above p% of them. samples must be sorted.
func benchPct(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(p/100*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// benchLatencies holds the samples of one side of a latency row.
type benchLatencies []time.Duration

func (l benchLatencies) sorted() benchLatencies {
	s := slices.Clone(l)
	slices.Sort(s)
	return s
}

// p50p99 formats "p50 / p99 ms" of l (sorted).
func (l benchLatencies) p50p99() string {
	if len(l) == 0 {
		return "no samples"
	}
	return fmt.Sprintf("%s / %s ms (n=%d)", benchMs(benchPct(l, 50)), benchMs(benchPct(l, 99)), len(l))
}

// benchMs formats d in milliseconds with a precision that suits its size.
func benchMs(d time.Duration) string {
	v := float64(d) / float64(time.Millisecond)
	switch a := math.Abs(v); {
	case a >= 100:
		return fmt.Sprintf("%.0f", v)
	case a >= 10:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.2f", v)
}

// benchRatio formats coord ÷ plain, naming the figure compared.
func benchRatio(coord, plain float64, what string) string {
	if plain <= 0 || coord < 0 {
		return "n/a (" + what + ")"
	}
	return fmt.Sprintf("%.2f (%s)", coord/plain, what)
}

// benchLatencyRow builds a row of p50 / p99 latencies, with the ratios of
// the p50s and of the p99s. offset is added to the samples for the ratios
// only: rows of latency minus the TTL compare the whole latencies.
func benchLatencyRow(scenario string, coord, plain benchLatencies, offset time.Duration, limit string) benchRow {
	c, p := coord.sorted(), plain.sorted()
	r := func(q float64) string {
		cv, pv := benchPct(c, q)+offset, benchPct(p, q)+offset
		if pv <= 0 || cv < 0 {
			return "n/a"
		}
		return fmt.Sprintf("%.2f", float64(cv)/float64(pv))
	}
	what := "p50 / p99"
	if offset != 0 {
		what += " of the whole latency"
	}
	return benchRow{
		scenario: scenario,
		coord:    c.p50p99(),
		plain:    p.p50p99(),
		ratio:    fmt.Sprintf("%s / %s (%s)", r(50), r(99), what),
		limit:    limit,
	}
}

// benchMedian returns the median of xs.
func benchMedian(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// benchCount formats n with thousands separators.
func benchCount(n int) string {
	s := fmt.Sprint(n)
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	return b.String()
}

// benchSecs formats a whole-ish duration in seconds ("1 s", "0.5 s").
func benchSecs(d time.Duration) string {
	return strconv.FormatFloat(d.Seconds(), 'g', 3, 64) + " s"
}

// benchPlural formats n things: "1 lease", "10 leases".
func benchPlural(n int, thing string) string {
	if n == 1 {
		return "1 " + thing
	}
	return benchCount(n) + " " + thing + "s"
}

// benchBytes writes n bytes in MB, to two decimals.
func benchBytes(n int64) string { return fmt.Sprintf("%.2f MB", float64(n)/1e6) }

// benchSlope is the least-squares slope of ys against xs; 0 with fewer
// than two distinct xs.
func benchSlope(xs, ys []float64) float64 {
	var mx, my float64
	for i := range xs {
		mx, my = mx+xs[i], my+ys[i]
	}
	n := float64(max(len(xs), 1))
	mx, my = mx/n, my/n
	var sxy, sxx float64
	for i := range xs {
		sxy += (xs[i] - mx) * (ys[i] - my)
		sxx += (xs[i] - mx) * (xs[i] - mx)
	}
	if sxx == 0 {
		return 0
	}
	return sxy / sxx
}
