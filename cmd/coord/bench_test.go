package main

import (
	"bytes"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-coord/coord/cmd/coord/internal/bench"
)

func TestBenchFlags(t *testing.T) {
	t.Run("quick picks the quick sizes", func(t *testing.T) {
		a, err := benchParseFlags([]string{"--quick", "--only", "2, 5"}, &bytes.Buffer{})
		if err != nil {
			t.Fatal(err)
		}
		cfg := a.cfg
		want := bench.Quick()
		want.Only = []int{2, 5}
		if !reflect.DeepEqual(cfg, want) {
			t.Errorf("config %+v, want %+v", cfg, want)
		}
	})
	t.Run("the default is the full run on an embedded etcd", func(t *testing.T) {
		a, err := benchParseFlags(nil, &bytes.Buffer{})
		if err != nil {
			t.Fatal(err)
		}
		if cfg := a.cfg; !reflect.DeepEqual(cfg, bench.Full()) {
			t.Errorf("config %+v", cfg)
		}
	})
	t.Run("endpoints name a cluster", func(t *testing.T) {
		a, err := benchParseFlags([]string{"--endpoints=127.0.0.1:1"}, &bytes.Buffer{})
		if err != nil {
			t.Fatal(err)
		}
		if cfg := a.cfg; cfg.Etcd == nil || !slices.Equal(cfg.Etcd.Endpoints, []string{"127.0.0.1:1"}) {
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
			a, err := benchParseFlags(args, &bytes.Buffer{})
			if cfg := a.cfg; err != nil || cfg.ShardTTL != 5*time.Second || cfg.ShardStagger != 0 {
				t.Errorf("%v: TTL %v, stagger %v, err %v", args, cfg.ShardTTL, cfg.ShardStagger, err)
			}
		}
		quick := bench.Quick()
		if a, _ := benchParseFlags([]string{"--quick"}, &bytes.Buffer{}); a.cfg.ShardTTL != quick.ShardTTL || a.cfg.ShardStagger != quick.ShardStagger {
			t.Errorf("--quick: TTL %v, stagger %v", a.cfg.ShardTTL, a.cfg.ShardStagger)
		}
	})
	t.Run("--json names the report's file; --render takes the reports", func(t *testing.T) {
		if a, err := benchParseFlags([]string{"--quick", "--json", "run.json"}, &bytes.Buffer{}); err != nil || a.json != "run.json" || a.render != nil {
			t.Errorf("--json: %+v, %v", a, err)
		}
		if a, err := benchParseFlags([]string{"--render", "a.json", "b.json"}, &bytes.Buffer{}); err != nil || !slices.Equal(a.render, []string{"a.json", "b.json"}) {
			t.Errorf("--render: %+v, %v", a, err)
		}
	})
	for _, args := range [][]string{{"--only", strconv.Itoa(bench.Scenarios + 1)}, {"--only", "0"}, {"--only", "x"}, {"extra"}, {"--render"}, {"--bogus"}, {"--shard-ttl", "1500ms"}, {"--shard-ttl", "0s"}, {"--shard-stagger", "-1s"}} {
		t.Run("refuses "+strings.Join(args, " "), func(t *testing.T) {
			_, err := benchParseFlags(args, &bytes.Buffer{})
			var uerr *usageError
			if !errors.As(err, &uerr) {
				t.Errorf("err %v, want a usage error", err)
			}
		})
	}
}

// benchPageBegin and benchPageEnd enclose, in BENCHMARKS.md, what
// `coord bench --render benchmarks/*.json` prints.
const (
	benchPageBegin = "<!-- begin: go run ./cmd/coord bench --render benchmarks/*.json -->\n"
	benchPageEnd   = "<!-- end: go run ./cmd/coord bench --render benchmarks/*.json -->\n"
)

// TestBenchmarksPage checks that the figures of BENCHMARKS.md are those
// of the runs in benchmarks/, as coord bench renders them: written by
// the bench, not by hand.
func TestBenchmarksPage(t *testing.T) {
	page, err := os.ReadFile("../../BENCHMARKS.md")
	if err != nil {
		t.Fatal(err)
	}
	files, err := filepath.Glob("../../benchmarks/*.json")
	if err != nil || len(files) == 0 {
		t.Fatalf("no run in benchmarks/: %v", err)
	}
	var want bytes.Buffer
	if err := benchRender(files, &want); err != nil {
		t.Fatal(err)
	}
	_, rest, ok1 := strings.Cut(string(page), benchPageBegin)
	got, _, ok2 := strings.Cut(rest, benchPageEnd)
	if !ok1 || !ok2 {
		t.Fatalf("BENCHMARKS.md lacks the lines %q and %q around its figures", benchPageBegin, benchPageEnd)
	}
	if got != want.String() {
		t.Errorf("BENCHMARKS.md's figures are not those of benchmarks/*.json: put the output of\n"+
			"  go run ./cmd/coord bench --render benchmarks/*.json\nbetween its lines %q and %q.\nIt has:\n%s\nwant:\n%s",
			benchPageBegin, benchPageEnd, got, &want)
	}
}
