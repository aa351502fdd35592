package main

import (
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/go-coord/coord"
	clientv3 "go.etcd.io/etcd/client/v3"
)

func TestAgent(t *testing.T) {
	t.Run("two agents share the shards; one leads and holds the permit; each serves its health; Ctrl-C hands everything over at once", func(t *testing.T) {
		_, ep, cli := newEtcd(t)
		common := []string{"agent", "--endpoints", ep, "--ttl", "2s", "--shards", "4",
			"--elect", "/coord/elections/agents", "--permit", "/coord/semaphores/agents", "--health", "127.0.0.1:0"}
		a := startCoord(t, append(common, "--host-uuid", "uuid-a", "--hostname", "node-a")...)
		a.waitOutput(t, a.stdout, "leading /coord/elections/agents")
		a.waitOutput(t, a.stdout, "holding a permit of /coord/semaphores/agents")
		b := startCoord(t, append(common, "--host-uuid", "uuid-b", "--hostname", "node-b")...)
		b.waitOutput(t, b.stderr, "agent health at ")
		owners := func() map[string]int {
			shards, err := listShards(tctx(t), cli, coord.ShardsPrefix, coord.HostsPrefix, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			m := map[string]int{}
			for _, s := range shards {
				m[s.Owner.Identity]++
			}
			return m
		}
		eventually(t, "the shards spread over both agents, each with a standby", func() bool {
			o := owners()
			return o["uuid-a"]+o["uuid-b"] == 4 && o["uuid-a"] > 0 && o["uuid-b"] > 0
		})
		health := strings.Fields(strings.SplitAfter(a.stderr.String(), "agent health at ")[1])[0]
		resp, err := http.Get(health + "?verbose")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for _, part := range []string{"[+]host ok", "[+]shards ok", "[+]election ok", "[+]permit ok"} {
			if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), part) {
				t.Fatalf("health: %s\n%s", resp.Status, body)
			}
		}

		// a stops: b owns every shard, leads and holds the permit, at
		// once (well before a's leases could expire).
		if r := a.stop(t); r.code != exitOK || !strings.Contains(r.stdout, "handed everything over, stopped") {
			t.Fatalf("agent a: status %d\n%s\n%s", r.code, r.stdout, r.stderr)
		}
		resp2, err := cli.Get(tctx(t), coord.HostsPrefix+"uuid-a")
		if err != nil || len(resp2.Kvs) != 0 {
			t.Fatalf("a's host key after its stop: %v, %v", resp2.Kvs, err)
		}
		b.waitOutput(t, b.stdout, "leading /coord/elections/agents")
		b.waitOutput(t, b.stdout, "holding a permit of /coord/semaphores/agents")
		eventually(t, "b owning every shard", func() bool { return owners()["uuid-b"] == 4 })
		if r := b.stop(t); r.code != exitOK {
			t.Fatalf("agent b: status %d\n%s\n%s", r.code, r.stdout, r.stderr)
		}
		left, err := cli.Get(tctx(t), "/coord/", clientv3.WithPrefix(), clientv3.WithKeysOnly())
		if err != nil {
			t.Fatal(err)
		}
		var keys []string
		for _, kv := range left.Kvs {
			keys = append(keys, string(kv.Key))
		}
		if slices.ContainsFunc(keys, func(k string) bool { return !strings.HasPrefix(k, "/coord/semaphores/agents") }) {
			t.Fatalf("keys left after both agents stopped: %v", keys)
		}
	})

	t.Run("bad flags are refused before dialling", func(t *testing.T) {
		for _, args := range [][]string{{"--shards", "0"}, {"--ttl", "1500ms"}, {"--limit", "0"},
			{"--shards-prefix", "/x"}, {"--elect", "/e/"}, {"--permit", "//p"}} {
			if r := runCoord(t, append([]string{"agent", "--endpoints", "127.0.0.1:1"}, args...)...); r.code != exitUsage {
				t.Errorf("agent %v: status %d, stderr %q", args, r.code, r.stderr)
			}
		}
	})
}
