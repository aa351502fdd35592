package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"slices"
	"strings"
	"testing"
	"time"
)

// benchTiny runs every scenario with the least that still measures it:
// small enough for the race detector.
var benchTiny = benchConfig{
	name:       "tiny",
	crashHosts: 3, crashTTL: time.Second, crashSpan: 200 * time.Millisecond,
	stopHosts:    3,
	resignRounds: 2, resignSettle: 150 * time.Millisecond,
	resignFreshRounds: 2, resignFreshSettle: 20 * time.Millisecond,
	leaderCrashes: 2,
	scaleSizes:    []int{50, 100}, scaleReps: 1,
	churnHosts: 40, churnRate: 100, churnFor: 300 * time.Millisecond,
	loadKeys: 5, loadLivenessTTL: time.Second, loadPoolTTL: 2 * time.Second, loadWindow: time.Second,
	campaignFor: 100 * time.Millisecond, campaignChunk: 50 * time.Millisecond,
	fleetAgents: 2, fleetKeys: 6, fleetMembers: 3,
	fleetLivenessTTL: time.Second, fleetPoolTTL: 2 * time.Second, fleetWindow: time.Second,
	shardHosts: 3, shardCount: 24, shardTTL: 2 * time.Second, shardStagger: 50 * time.Millisecond,
	shardNaiveHosts: 2, shardNaiveCount: 12,
}

func TestBenchPrintsEveryRow(t *testing.T) {
	if testing.Short() {
		t.Skip("runs every scenario on an embedded etcd")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute*scale)
	defer cancel()
	var stdout, stderr bytes.Buffer
	if err := benchRun(ctx, benchTiny, &stdout, &stderr); err != nil {
		t.Fatalf("bench: %v\nstdout:\n%s\nstderr:\n%s", err, &stdout, &stderr)
	}
	out := stdout.String()
	t.Logf("\n%s", out)
	var rows []string
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "| ") && !strings.HasPrefix(line, "| scenario ") {
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
	// memory where they can be measured; 10 has five for its size and,
	// the naive plan running at another size, five more for that one.
	want := map[string]int{"1.": 1, "1b.": 1, "2.": 1, "3.": 1, "3b.": 1, "4.": 1, "4b.": 1, "5.": 2 * len(benchTiny.scaleSizes), "6.": 1, "7.": 3, "8.": 1, "9.": 4,
		"10.": 5, "10b.": 5}
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
	if !strings.Contains(stderr.String(), "scenario 10: done") {
		t.Errorf("no progress on stderr:\n%s", &stderr)
	}
}

func TestBenchFlags(t *testing.T) {
	t.Run("quick picks the quick sizes", func(t *testing.T) {
		cfg, err := benchParseFlags([]string{"--quick", "--only", "2, 5"}, &bytes.Buffer{})
		if err != nil {
			t.Fatal(err)
		}
		if cfg.name != "quick" || cfg.crashHosts != benchQuick.crashHosts || !slices.Equal(cfg.only, []int{2, 5}) || cfg.conn != nil {
			t.Errorf("config %+v", cfg)
		}
	})
	t.Run("the default is the full run on an embedded etcd", func(t *testing.T) {
		cfg, err := benchParseFlags(nil, &bytes.Buffer{})
		if err != nil {
			t.Fatal(err)
		}
		if cfg.name != "full" || cfg.conn != nil || len(cfg.only) != 0 {
			t.Errorf("config %+v", cfg)
		}
	})
	t.Run("endpoints name a cluster", func(t *testing.T) {
		cfg, err := benchParseFlags([]string{"--endpoints=127.0.0.1:1"}, &bytes.Buffer{})
		if err != nil {
			t.Fatal(err)
		}
		if cfg.conn == nil || cfg.conn.endpoints != "127.0.0.1:1" {
			t.Errorf("config %+v", cfg)
		}
	})
	t.Run("help goes to stdout", func(t *testing.T) {
		var stdout bytes.Buffer
		_, err := benchParseFlags([]string{"-h"}, &stdout)
		if !errors.Is(err, flag.ErrHelp) || !strings.Contains(stdout.String(), "--quick") {
			t.Errorf("err %v, help:\n%s", err, &stdout)
		}
	})
	t.Run("shard-ttl and shard-stagger set scenario 10's, quick or not", func(t *testing.T) {
		for _, args := range [][]string{{"--shard-ttl", "5s", "--shard-stagger", "0"}, {"--quick", "--shard-ttl=5s", "--shard-stagger=0s"}} {
			cfg, err := benchParseFlags(args, &bytes.Buffer{})
			if err != nil || cfg.shardTTL != 5*time.Second || cfg.shardStagger != 0 {
				t.Errorf("%v: TTL %v, stagger %v, err %v", args, cfg.shardTTL, cfg.shardStagger, err)
			}
		}
		if cfg, _ := benchParseFlags([]string{"--quick"}, &bytes.Buffer{}); cfg.shardTTL != benchQuick.shardTTL || cfg.shardStagger != benchQuick.shardStagger {
			t.Errorf("--quick: TTL %v, stagger %v", cfg.shardTTL, cfg.shardStagger)
		}
	})
	for _, args := range [][]string{{"--only", "11"}, {"--only", "x"}, {"extra"}, {"--bogus"}, {"--shard-ttl", "1500ms"}, {"--shard-ttl", "0s"}, {"--shard-stagger", "-1s"}} {
		t.Run("refuses "+strings.Join(args, " "), func(t *testing.T) {
			_, err := benchParseFlags(args, &bytes.Buffer{})
			var uerr *usageError
			if !errors.As(err, &uerr) {
				t.Errorf("err %v, want a usage error", err)
			}
		})
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
