package main

import (
	"bytes"
	"errors"
	"flag"
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
		cfg, err := benchParseFlags([]string{"--quick", "--only", "2, 5"}, &bytes.Buffer{})
		if err != nil {
			t.Fatal(err)
		}
		want := bench.Quick()
		want.Only = []int{2, 5}
		if !reflect.DeepEqual(cfg, want) {
			t.Errorf("config %+v, want %+v", cfg, want)
		}
	})
	t.Run("the default is the full run on an embedded etcd", func(t *testing.T) {
		cfg, err := benchParseFlags(nil, &bytes.Buffer{})
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(cfg, bench.Full()) {
			t.Errorf("config %+v", cfg)
		}
	})
	t.Run("endpoints name a cluster", func(t *testing.T) {
		cfg, err := benchParseFlags([]string{"--endpoints=127.0.0.1:1"}, &bytes.Buffer{})
		if err != nil {
			t.Fatal(err)
		}
		if cfg.Etcd == nil || !slices.Equal(cfg.Etcd.Endpoints, []string{"127.0.0.1:1"}) {
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
			if err != nil || cfg.ShardTTL != 5*time.Second || cfg.ShardStagger != 0 {
				t.Errorf("%v: TTL %v, stagger %v, err %v", args, cfg.ShardTTL, cfg.ShardStagger, err)
			}
		}
		quick := bench.Quick()
		if cfg, _ := benchParseFlags([]string{"--quick"}, &bytes.Buffer{}); cfg.ShardTTL != quick.ShardTTL || cfg.ShardStagger != quick.ShardStagger {
			t.Errorf("--quick: TTL %v, stagger %v", cfg.ShardTTL, cfg.ShardStagger)
		}
	})
	for _, args := range [][]string{{"--only", strconv.Itoa(bench.Scenarios + 1)}, {"--only", "0"}, {"--only", "x"}, {"extra"}, {"--bogus"}, {"--shard-ttl", "1500ms"}, {"--shard-ttl", "0s"}, {"--shard-stagger", "-1s"}} {
		t.Run("refuses "+strings.Join(args, " "), func(t *testing.T) {
			_, err := benchParseFlags(args, &bytes.Buffer{})
			var uerr *usageError
			if !errors.As(err, &uerr) {
				t.Errorf("err %v, want a usage error", err)
			}
		})
	}
}
