package coord

import (
	"fmt"
	"slices"
	"testing"
	"time"
)

func TestSignals(t *testing.T) {
	t.Run("a registration signals registered, heals and its end", func(t *testing.T) {
		_, cli := newEtcd(t)
		var s signals
		h := register(t, cli, "a", LivenessOptions{OnSignal: s.hook})
		first := s.waitFor(t, SignalRegistered, 1)
		if first.Host != "a" || first.Key != h.Key() || first.Lease != h.LeaseID() || first.Attempt != 0 {
			t.Fatalf("first registration %+v", first)
		}
		if _, err := cli.Delete(testCtx(t), h.Key()); err != nil {
			t.Fatal(err)
		}
		if healed := s.waitFor(t, SignalRegistered, 2); healed.Attempt != 1 {
			t.Fatalf("heal %+v", healed)
		}
		if err := h.Stop(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		if end := s.waitFor(t, SignalRegistrationEnded, 1); end.Err != nil {
			t.Fatalf("end after Stop %+v", end)
		}
	})
	t.Run("an election signals leadership gained and lost with its token", func(t *testing.T) {
		_, cli := newEtcd(t)
		var s signals
		e, err := NewElection(testCtx(t), cli, ElectionOptions{Key: "/k", TTL: time.Second, OnSignal: s.hook})
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		if err := e.Campaign(testCtx(t), "a"); err != nil {
			t.Fatal(err)
		}
		token := e.Token()
		if err := e.Resign(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		lost := s.waitFor(t, SignalLeadershipLost, 1)
		if gained := s.waitFor(t, SignalLeadershipGained, 1); gained.Token != token || lost.Token != token || lost.Key != "/k" {
			t.Fatalf("gained %+v lost %+v, token %d", gained, lost, token)
		}
	})
	t.Run("a pooled election signals through the pool's hook", func(t *testing.T) {
		_, cli := newEtcd(t)
		var s signals
		p, err := NewElectionPool(cli, PoolOptions{TTL: time.Second, OnSignal: s.hook})
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		e, err := p.Election(testCtx(t), "/k")
		if err != nil {
			t.Fatal(err)
		}
		if err := e.Campaign(testCtx(t), "a"); err != nil {
			t.Fatal(err)
		}
		s.waitFor(t, SignalLeadershipGained, 1)
	})
	t.Run("a watcher signals delivered events and resyncs", func(t *testing.T) {
		srv, cli := newEtcd(t)
		var s signals
		register(t, cli, "a", LivenessOptions{})
		w, err := NewHostWatcher(testCtx(t), cli, WatcherOptions{OnSignal: s.hook})
		if err != nil {
			t.Fatal(err)
		}
		defer w.Close()
		expect(t, w, HostUp, "a")
		if d := s.waitFor(t, SignalEventDelivered, 1); d.Host != "a" || d.Event != HostUp || d.Key != HostsPrefix {
			t.Fatalf("delivered %+v", d)
		}
		// Compaction then restart: the watch comes back compacted.
		for i := range 3 {
			if _, err := cli.Put(testCtx(t), fmt.Sprintf("/other/%d", i), "x"); err != nil {
				t.Fatal(err)
			}
		}
		srv.Compact(testCtx(t))
		srv.Restart()
		if r := s.waitFor(t, SignalWatcherResync, 1); r.Count != 0 {
			t.Fatalf("resync %+v: nothing changed, want 0 differences", r)
		}
		quiet(t, cli, w, HostsPrefix)
	})
	t.Run("kinds have names", func(t *testing.T) {
		var names []string
		for k := SignalRegistered; k <= SignalPermitResumed+1; k++ {
			names = append(names, k.String())
		}
		want := []string{"registered", "heal-attempt", "registration-ended", "leadership-gained",
			"leadership-lost", "watcher-resync", "event-delivered", "shard-acquired", "shard-released",
			"watcher-listing-compacted", "permit-acquired", "permit-released", "etcd-replaced",
			"leadership-resumed", "permit-resumed", "SignalKind(15)"}
		if !slices.Equal(names, want) || SignalKind(-1).String() != "SignalKind(-1)" {
			t.Fatalf("names %v", names)
		}
	})
}
