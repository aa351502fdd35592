package bench

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

// benchTiny runs every scenario with the least that still measures it:
// small enough for the race detector. It is the quick run made smaller.
var benchTiny = func() Config {
	c := Quick()
	c.name = "tiny"
	c.crashHosts, c.crashSpan, c.stopHosts, c.leaderCrashes = 3, 200*time.Millisecond, 3, 2
	c.resignRounds, c.resignFreshRounds = 2, 2
	c.scaleSizes, c.scaleReps = []int{50, 100}, 1
	c.churnHosts, c.churnRate, c.churnFor = 40, 100, 300*time.Millisecond
	c.loadKeys, c.loadLivenessTTL, c.loadPoolTTL, c.loadWindow = 5, time.Second, 2*time.Second, time.Second
	c.campaignFor, c.campaignChunk = 100*time.Millisecond, 50*time.Millisecond
	c.fleetAgents, c.fleetKeys = 2, 6
	c.fleetLivenessTTL, c.fleetPoolTTL, c.fleetWindow = time.Second, 2*time.Second, time.Second
	c.shardHosts, c.shardCount, c.shardNaiveHosts, c.shardNaiveCount = 3, 24, 2, 12
	c.semContenders, c.semFor, c.semChunk, c.semRounds, c.semSettle = 6, 100*time.Millisecond, 50*time.Millisecond, 2, 20*time.Millisecond
	c.wideAgents, c.wideShards, c.wideUpdates, c.wideRate = []int{2, 4}, 4, 4, 100
	return c
}()

func TestBenchPrintsEveryRow(t *testing.T) {
	if testing.Short() {
		t.Skip("runs every scenario on an embedded etcd")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute*scale)
	defer cancel()
	var stdout, stderr, report bytes.Buffer
	cfg := benchTiny
	cfg.Progress, cfg.JSON, cfg.Command = &stderr, &report, "coord bench --tiny"
	if err := Run(ctx, cfg, &stdout); err != nil {
		t.Fatalf("bench: %v\nstdout:\n%s\nstderr:\n%s", err, &stdout, &stderr)
	}
	out := stdout.String()
	t.Logf("\n%s", out)
	var rows []string
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "| ") && !strings.HasPrefix(line, "| scenario ") && !strings.HasPrefix(line, "| --- ") {
			rows = append(rows, line)
			if cells := strings.Count(line, " | ") + 1; cells != 5 {
				t.Errorf("row with %d cells, want 5: %s", cells, line)
			}
			if strings.Contains(line, "failed:") || strings.Contains(line, "no samples") {
				t.Errorf("row without a measurement: %s", line)
			}
		}
	}
	// Scenario 5 has two rows per size; 7 has three, and one for the CPU
	// where it can be measured; 9 has four, and three for the CPU and
	// memory where they can be measured; 10 has seven for its size (the
	// last two: a drain, a rolling restart) and, the naive plan running
	// at another size, five more for that one; 11 has one, and 11b one;
	// 12 three per fleet size (its updates, its etcd replaced under the
	// watchers straight to etcd, and under those through the proxy), and
	// two over the sizes.
	want := map[string]int{"1.": 1, "1b.": 1, "2.": 1, "3.": 1, "3b.": 1, "4.": 1, "4b.": 1, "5.": 2 * len(benchTiny.scaleSizes), "6.": 1, "7.": 3, "8.": 1, "9.": 4,
		"10.": 7, "10b.": 5, "11.": 1, "11b.": 1, "12.": 3*len(benchTiny.wideAgents) + 2}
	got := map[string]int{}
	for _, r := range rows {
		got[strings.Fields(r)[1]]++
	}
	for s, n := range want {
		if got[s] < n {
			t.Errorf("%d rows for scenario %s, want %d", got[s], s, n)
		}
	}
	if !strings.Contains(out, "| scenario | coord | plain etcd | ratio | limit |") {
		t.Error("no table header")
	}
	if !strings.Contains(stderr.String(), "scenario 12: done") {
		t.Errorf("no progress on stderr:\n%s", &stderr)
	}

	// The report holds every row of the table, and renders as the table
	// of BENCHMARKS.md, each row naming its run.
	rep, err := ReadReport(report.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Rows) != len(rows) || rep.Command != cfg.Command || rep.CPUs < 1 || rep.Started.IsZero() || rep.Took == "" || rep.Etcd == "" {
		t.Fatalf("report of %d rows (the table has %d): %+v", len(rep.Rows), len(rows), rep)
	}
	var page bytes.Buffer
	Render(&page, []Report{rep})
	for i, r := range rep.Rows {
		if want := "| " + cell(r.Scenario) + " | " + cell(r.Coord) + " | "; !strings.Contains(page.String(), want) || !strings.Contains(rows[i], want) {
			t.Errorf("row %d, %q, not in the table or the page:\n%s", i, want, &page)
		}
	}
	if !strings.Contains(page.String(), "- **Run A**: `coord bench --tiny`, started ") {
		t.Errorf("the page does not name the run:\n%s", &page)
	}
}

// TestBenchRender: each scenario from the latest run that has it, its
// rows in order, and only the runs the table uses listed.
func TestBenchRender(t *testing.T) {
	at := func(h int) time.Time { return time.Date(2026, 12, 4, h, 0, 0, 0, time.UTC) }
	old := Report{Command: "coord bench", Started: at(1), Commit: "aaa", Load: [2]string{"0.5", "0.6"}, Etcd: "e", CPUs: 2,
		Rows: []Row{{Scenario: "1. crash", Coord: "old"}, {Scenario: "3. resign", Coord: "old"}, {Scenario: "3b. resign fresh", Coord: "old"}}}
	newer := Report{Command: "coord bench --only 3", Started: at(2), Etcd: "e", CPUs: 2,
		Rows: []Row{{Scenario: "3. resign", Coord: "new | piped"}, {Scenario: "3b. resign fresh", Coord: "new"}}}
	unused := Report{Command: "coord bench --only 1", Started: at(0), Rows: []Row{{Scenario: "1. crash", Coord: "oldest"}}}
	var page bytes.Buffer
	Render(&page, []Report{newer, unused, old})
	want := `| scenario | coord | plain etcd | ratio | goal or limit | run |
| --- | --- | --- | --- | --- | --- |
| 1. crash | old |  |  |  | A |
| 3. resign | new \| piped |  |  |  | B |
| 3b. resign fresh | new |  |  |  | B |

- **Run A**: ` + "`coord bench`" + `, started 2026-12-04 01:00 UTC, took ; commit aaa; e, 2 cores,  /; load average 0.5 at the start, 0.6 at the end.
- **Run B**: ` + "`coord bench --only 3`" + `, started 2026-12-04 02:00 UTC, took ; commit unknown; e, 2 cores,  /; load average unknown at the start, unknown at the end.
`
	if page.String() != want {
		t.Errorf("page:\n%s\nwant:\n%s", &page, want)
	}
}

func TestBenchPercentile(t *testing.T) {
	var s []time.Duration
	for i := 1; i <= 100; i++ {
		s = append(s, time.Duration(i))
	}
	for _, c := range []struct {
		p    float64
		want time.Duration
	}{{50, 50}, {99, 99}, {100, 100}, {1, 1}, {0, 1}} {
		if got := benchPct(s, c.p); got != c.want {
			t.Errorf("p%v = %v, want %v", c.p, got, c.want)
		}
	}
	if got := benchPct(s[:20], 99); got != 20 {
		t.Errorf("p99 of 20 samples = %v, want the largest", got)
	}
	if got := benchPct(nil, 50); got != 0 {
		t.Errorf("p50 of nothing = %v", got)
	}
}
