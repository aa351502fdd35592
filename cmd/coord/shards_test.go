package main

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-coord/coord"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// shardsJSON runs coord shards -o json with args and decodes its output.
func shardsJSON(t *testing.T, args ...string) []shardInfo {
	t.Helper()
	r := runCoord(t, append([]string{"shards", "-o", "json"}, args...)...)
	var out []shardInfo
	if err := json.Unmarshal([]byte(r.stdout), &out); err != nil || r.code != exitOK {
		t.Fatalf("coord shards -o json %s: status %d, %v\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), r.code, err, r.stdout, r.stderr)
	}
	return out
}

// line returns the identities of a shard's candidates, the owner first.
func (s shardInfo) line() []string {
	ids := []string{s.Owner.Identity}
	for _, c := range s.Standbys {
		ids = append(ids, c.Identity)
	}
	return ids
}

func TestShards(t *testing.T) {
	t.Parallel()
	srv, ep, cli := newEtcd(t)
	count := func(prefix string) int64 {
		t.Helper()
		resp, err := cli.Get(tctx(t), prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			t.Fatal(err)
		}
		return resp.Count
	}

	t.Run("plain elections: the owner, its token, the standbys in line order", func(t *testing.T) {
		ctx := tctx(t)
		const prefix = "/plain/"
		var es []*coord.Election
		for _, id := range []string{"host-1", "host-2", "host-3"} {
			e, err := coord.NewElection(ctx, srv.NewClient(t), coord.ElectionOptions{Key: prefix + "alpha", Identity: id})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { e.Close() })
			es = append(es, e)
		}
		if err := es[0].Campaign(ctx, ""); err != nil {
			t.Fatal(err)
		}
		// The others queue, one after the other.
		done := make(chan error, 2)
		for i, e := range es[1:] {
			go func() { done <- e.Campaign(ctx, "") }()
			eventually(t, "in line", func() bool { return count(prefix+"alpha/") == int64(i+2) })
		}
		// A shard of one candidate.
		solo, err := coord.NewElection(ctx, srv.NewClient(t), coord.ElectionOptions{Key: prefix + "beta", Identity: "host-9"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { solo.Close() })
		if err := solo.Campaign(ctx, ""); err != nil {
			t.Fatal(err)
		}

		r := runCoord(t, "shards", "--endpoints", ep, "--prefix", prefix)
		if r.code != exitOK || r.stderr != "" {
			t.Fatalf("status %d, stderr %q", r.code, r.stderr)
		}
		lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
		want := [][]string{
			{"SHARD", "OWNER", "TOKEN", "STANDBYS"},
			{"alpha", "host-1", fmt.Sprint(es[0].Token()), "host-2,host-3"},
			{"beta", "host-9", fmt.Sprint(solo.Token()), "-"},
		}
		if len(lines) != len(want) {
			t.Fatalf("want a header and 2 shards, got:\n%s", r.stdout)
		}
		for i, w := range want {
			if got := strings.Fields(lines[i]); !slices.Equal(got, w) {
				t.Errorf("line %d: %q, want %q", i, got, w)
			}
		}

		got := shardsJSON(t, "--endpoints", ep, "--prefix", prefix)
		if len(got) != 2 || got[0].Shard != "alpha" || got[0].Key != prefix+"alpha" || got[1].Shard != "beta" {
			t.Fatalf("got %+v", got)
		}
		a := got[0]
		if !slices.Equal(a.line(), []string{"host-1", "host-2", "host-3"}) || a.Owner.Token != es[0].Token() || a.Owner.Lease == "" ||
			!(a.Owner.Token < a.Standbys[0].Token && a.Standbys[0].Token < a.Standbys[1].Token) {
			t.Fatalf("alpha: %+v", a)
		}
		if b := got[1]; b.Standbys == nil || len(b.Standbys) != 0 {
			t.Fatalf("beta: standbys %#v, want an empty list", b.Standbys)
		}

		// The owner resigns: the first standby owns the shard, with its
		// candidacy's revision as its token.
		if err := es[0].Resign(ctx); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		got = shardsJSON(t, "--endpoints", ep, "--prefix", prefix)
		if a := got[0]; !slices.Equal(a.line(), []string{"host-2", "host-3"}) || a.Owner.Token != es[1].Token() {
			t.Fatalf("after the owner resigned: %+v, want host-2 owning with token %d", a, es[1].Token())
		}
	})

	t.Run("ShardSets: each shard's owner and standby, as the shard sets place them", func(t *testing.T) {
		ctx := tctx(t)
		shards := []string{"s-0", "s-1", "s-2", "s-3", "s-4", "s-5"}
		ids := []string{"host-a", "host-b", "host-c"}
		sets := map[string]*coord.ShardSet{}
		lives := map[string]*coord.HostLiveness{}
		clis := map[string]*clientv3.Client{}
		// Every host is live before any shard set starts: none of them
		// ends a candidacy because another host came up.
		for _, id := range ids {
			clis[id] = srv.NewClient(t)
			lives[id] = register(t, clis[id], coord.HostMetadata{HostUUID: id, Hostname: "name-of-" + id}, coord.LivenessOptions{TTL: 2 * time.Second * scale})
		}
		for _, id := range ids {
			s, err := coord.NewShardSet(ctx, clis[id], coord.ShardOptions{Shards: shards, Self: id, TTL: 2 * time.Second * scale,
				Run: func(ctx context.Context, _ coord.Shard) { <-ctx.Done() }})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			sets[id] = s
		}
		// The shard sets run the shards where coord shards says, with the
		// tokens it shows.
		agree := func() bool {
			for _, s := range shardsJSON(t, "--endpoints", ep) {
				owned := sets[s.Owner.Identity].Owned()
				if !slices.ContainsFunc(owned, func(o coord.Shard) bool { return o.Name == s.Shard && o.Token == s.Owner.Token }) {
					return false
				}
			}
			return true
		}
		eventually(t, "the shards placed by rendezvous hashing", func() bool { return placedOn(t, ep, shards, ids) && agree() })
		// Each candidate with the hostname its host registered.
		for _, s := range shardsJSON(t, "--endpoints", ep) {
			for _, c := range append([]shardCandidate{s.Owner}, s.Standbys...) {
				if c.Hostname != "name-of-"+c.Identity {
					t.Fatalf("%s: candidate %+v, want hostname name-of-%s", s.Shard, c, c.Identity)
				}
			}
		}
		if r := runCoord(t, "shards", "--endpoints", ep); !strings.Contains(r.stdout, " host-a (name-of-host-a)") {
			t.Fatalf("the table does not show host-a's hostname:\n%s", r.stdout)
		}
		for _, s := range shards {
			owner, err := sets["host-a"].Owner(ctx, s)
			if want := shardRank(s, ids)[0]; err != nil || owner != want {
				t.Fatalf("%s: Owner = %q, %v; want %s", s, owner, err, want)
			}
		}
		// A host leaves: its shards go to their standbys, and the other
		// host queues behind them.
		sets["host-b"].Close()
		if err := lives["host-b"].Stop(ctx); err != nil {
			t.Fatal(err)
		}
		eventually(t, "host-b's shards placed on the others", func() bool {
			return placedOn(t, ep, shards, []string{"host-a", "host-c"}) && agree()
		})
	})

	t.Run("keys that are no candidates are skipped; --prefix before the command", func(t *testing.T) {
		ctx := tctx(t)
		const prefix = "/odd/"
		for k, v := range map[string]string{
			prefix + "flat":      "x",      // no lease segment
			prefix + "a/b/c":     "x",      // nested
			prefix + "/lease":    "x",      // no shard name
			prefix + "s/694d1":   "host-z", // a candidate without a lease
			"/odd-other/s/694d1": "x",      // not under the prefix
		} {
			if _, err := cli.Put(ctx, k, v); err != nil {
				t.Fatal(err)
			}
		}
		r := runCoord(t, "--prefix", prefix, "shards", "--endpoints", ep)
		if r.code != exitOK {
			t.Fatalf("status %d, stderr %q", r.code, r.stderr)
		}
		lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
		if len(lines) != 2 || !slices.Equal(strings.Fields(lines[1])[:2], []string{"s", "host-z"}) {
			t.Fatalf("want a header and shard s, got:\n%s", r.stdout)
		}
		for _, k := range []string{"flat", "a/b/c", "/lease"} {
			if !strings.Contains(r.stderr, "skipping "+prefix+k+": not a candidate key") {
				t.Errorf("stderr does not say %s was skipped:\n%s", k, r.stderr)
			}
		}
		if got := shardsJSON(t, "--endpoints", ep, "--prefix", prefix); len(got) != 1 || got[0].Owner.Lease != "0" {
			t.Fatalf("got %+v", got)
		}
	})

	t.Run("no shards: an empty list, and a note on stderr", func(t *testing.T) {
		checkEmptyListing(t, ep, "shards", "shard")
		if n := count(""); n == 0 {
			t.Fatal("no key at all: the test reads nothing")
		}
	})

	t.Run("usage errors exit 2 before dialling, an unreachable etcd 1", func(t *testing.T) {
		for _, tc := range []struct {
			args []string
			want string
		}{
			{[]string{"shards", "extra"}, `unexpected argument "extra"`},
			{[]string{"shards", "-o", "table"}, `-o "table": want text or json`},
			{[]string{"shards", "--prefix", "/coord/shards"}, "must end in /"},
			{[]string{"shards", "--host-prefix", "/coord/hosts"}, `--host-prefix "/coord/hosts" must end in /`},
			{[]string{"shards", "--bogus"}, "flag provided but not defined"},
		} {
			r := runCoord(t, tc.args...)
			if r.code != exitUsage || !strings.Contains(r.stderr, tc.want) || !strings.Contains(r.stderr, "for usage") {
				t.Errorf("coord %s: status %d, stderr %q; want %d, saying %q", strings.Join(tc.args, " "), r.code, r.stderr, exitUsage, tc.want)
			}
		}
		r := runCoord(t, "shards", "--endpoints", "127.0.0.1:1", "--dial-timeout", "300ms")
		if r.code != exitError || !strings.Contains(r.stderr, "etcd at 127.0.0.1:1") {
			t.Fatalf("status %d, stderr %q", r.code, r.stderr)
		}
		if r := runCoord(t, "-h"); !strings.Contains(r.stdout, "shards") {
			t.Fatalf("coord -h does not list shards:\n%s", r.stdout)
		}
	})
}

// tctx returns a context that bounds a test's calls, ended with it.
func tctx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	t.Cleanup(cancel)
	return ctx
}

// placedOn reports whether coord shards shows each of shards (sorted)
// owned by the host of live that ranks first for it, the next-ranked in
// line behind it, and nobody else.
func placedOn(t *testing.T, ep string, shards, live []string) bool {
	t.Helper()
	got := shardsJSON(t, "--endpoints", ep)
	if len(got) != len(shards) {
		return false
	}
	for i, s := range got {
		if s.Shard != shards[i] || !slices.Equal(s.line(), shardRank(s.Shard, live)[:2]) {
			return false
		}
	}
	return true
}
