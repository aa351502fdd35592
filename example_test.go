package coord_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/go-coord/coord"
	"github.com/go-coord/coord/coordtest"
)

// exampleWait bounds every wait of the examples: events arrive within
// milliseconds on an embedded etcd.
const exampleWait = 5 * time.Second

// exampleEtcd starts an embedded etcd for an example and returns a client of
// it, and a function that closes the client and the server and removes the
// data. A program would connect to its cluster instead:
//
//	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{"127.0.0.1:2379"}})
func exampleEtcd() (*clientv3.Client, func()) {
	dir, err := os.MkdirTemp("", "coord-example-")
	if err != nil {
		log.Fatal(err)
	}
	srv, err := coordtest.Start(dir, coordtest.Config{})
	if err != nil {
		os.RemoveAll(dir)
		log.Fatal(err)
	}
	return srv.Client(), func() {
		srv.Close()
		os.RemoveAll(dir)
	}
}

// exampleEvent returns the next event of w, waiting at most exampleWait.
func exampleEvent(w *coord.HostWatcher) coord.HostEvent {
	select {
	case ev, ok := <-w.Events():
		if !ok {
			log.Fatalf("events closed: %v", w.Err())
		}
		return ev
	case <-time.After(exampleWait):
		log.Fatal("no host event")
	}
	panic("unreachable")
}

// exampleLeader returns the next leader sent on an Observe channel, waiting
// at most exampleWait; ok is false once the channel is closed.
func exampleLeader(obs <-chan string) (leader string, ok bool) {
	select {
	case leader, ok = <-obs:
		return leader, ok
	case <-time.After(exampleWait):
		log.Fatal("no leader change observed")
	}
	panic("unreachable")
}

// exampleClosed waits at most exampleWait for ch to be closed.
func exampleClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	case <-time.After(exampleWait):
		return false
	}
}

func printEvent(ev coord.HostEvent) {
	fmt.Printf("%-7s %s (%s %s) synthetic=%t\n",
		ev.Kind, ev.HostUUID, ev.Metadata.Hostname, ev.Metadata.Version, ev.Synthetic)
}

func ExampleRegisterHostLiveness() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	// Announce this host: a lease at /coord/hosts/<uuid>, kept alive,
	// self-healing, until Stop.
	meta := coord.HostMetadata{HostUUID: "3f1c", Hostname: "node-1", Version: "1.4.2"}
	h, err := coord.RegisterHostLiveness(ctx, cli, meta, coord.LivenessOptions{TTL: time.Second})
	if err != nil {
		log.Fatal(err)
	}
	defer h.Stop(context.Background())
	fmt.Println("registered at", h.Key(), "with TTL", h.TTL())

	// Another agent follows the fleet: it starts with a synthetic Up for
	// each host already there.
	w, err := coord.NewHostWatcher(ctx, cli, coord.WatcherOptions{})
	if err != nil {
		log.Fatal(err)
	}
	defer w.Close()
	printEvent(exampleEvent(w))

	// New metadata, same lease: the watcher sees it updated.
	meta.Version = "1.4.3"
	if err := h.Update(ctx, meta); err != nil {
		log.Fatal(err)
	}
	printEvent(exampleEvent(w))

	// Stop revokes the lease: the watcher sees the host down at once, with
	// its last metadata.
	if err := h.Stop(ctx); err != nil {
		log.Fatal(err)
	}
	printEvent(exampleEvent(w))
	fmt.Println("done:", exampleClosed(h.Done()), "err:", h.Err())

	// Output:
	// registered at /coord/hosts/3f1c with TTL 1s
	// up      3f1c (node-1 1.4.2) synthetic=true
	// updated 3f1c (node-1 1.4.3) synthetic=false
	// down    3f1c (node-1 1.4.3) synthetic=false
	// done: true err: <nil>
}

func ExampleNewHostWatcher() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	register := func(id, hostname string) *coord.HostLiveness {
		h, err := coord.RegisterHostLiveness(ctx, cli,
			coord.HostMetadata{HostUUID: id, Hostname: hostname, Version: "1.0"},
			coord.LivenessOptions{TTL: time.Second})
		if err != nil {
			log.Fatal(err)
		}
		return h
	}
	// This agent is host "a"; "b" and "c" are up already.
	self := register("a", "node-a")
	defer self.Stop(context.Background())
	b := register("b", "node-b")
	defer b.Stop(context.Background())
	c := register("c", "node-c")
	defer c.Stop(context.Background())

	// Self: this agent's own events are not delivered.
	w, err := coord.NewHostWatcher(ctx, cli, coord.WatcherOptions{Self: "a"})
	if err != nil {
		log.Fatal(err)
	}
	defer w.Close()

	// The snapshot: a synthetic Up per host, then Synced.
	printEvent(exampleEvent(w))
	printEvent(exampleEvent(w))
	fmt.Println("synced:", exampleClosed(w.Synced()))
	for _, m := range w.Hosts() {
		fmt.Println("host", m.HostUUID, m.Hostname)
	}

	// Then every change, as it happens. Our own update is not delivered:
	// the next event is d coming up.
	if err := self.Update(ctx, coord.HostMetadata{HostUUID: "a", Hostname: "node-a", Version: "2.0"}); err != nil {
		log.Fatal(err)
	}
	d := register("d", "node-d")
	defer d.Stop(context.Background())
	printEvent(exampleEvent(w))
	if err := b.Stop(ctx); err != nil {
		log.Fatal(err)
	}
	printEvent(exampleEvent(w))

	// Output:
	// up      b (node-b 1.0) synthetic=true
	// up      c (node-c 1.0) synthetic=true
	// synced: true
	// host b node-b
	// host c node-c
	// up      d (node-d 1.0) synthetic=false
	// down    b (node-b 1.0) synthetic=false
}

func ExampleElection_Campaign() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	e, err := coord.NewElection(ctx, cli, coord.ElectionOptions{Key: "/coord/elections/scheduler", TTL: time.Second})
	if err != nil {
		log.Fatal(err)
	}
	defer e.Close()
	if err := e.Campaign(ctx, "node-1"); err != nil {
		log.Fatal(err)
	}
	leader, err := e.Leader(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("leader:", leader, "is leader:", e.IsLeader(), "token > 0:", e.Token() > 0)

	// Work on etcd is fenced: a write under Guard applies only while we
	// still lead.
	write := func() bool {
		resp, err := cli.Txn(ctx).If(e.Guard()).Then(clientv3.OpPut("/scheduler/owner", "node-1")).Commit()
		if err != nil {
			log.Fatal(err)
		}
		return resp.Succeeded
	}
	fmt.Println("guarded write while leading:", write())

	// Done closes when this leadership ends: here by Resign.
	done := e.Done()
	if err := e.Resign(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Println("done closed:", exampleClosed(done), "is leader:", e.IsLeader(), "token:", e.Token())
	fmt.Println("guarded write after resigning:", write())
	_, err = e.Leader(ctx)
	fmt.Println("no leader:", errors.Is(err, coord.ErrNoLeader))

	// Output:
	// leader: node-1 is leader: true token > 0: true
	// guarded write while leading: true
	// done closed: true is leader: false token: 0
	// guarded write after resigning: false
	// no leader: true
}

// The campaign loop of an agent: leadership ends (here, an operator
// deletes the leader key), the work of that term stops, and the agent
// queues again, leading anew with a higher fencing token.
func ExampleElection_Campaign_again() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	e, err := coord.NewElection(ctx, cli, coord.ElectionOptions{Key: "/coord/elections/scheduler", TTL: time.Second})
	if err != nil {
		log.Fatal(err)
	}
	defer e.Close()
	// The leader's work, each of its writes under guard, until ctx ends.
	schedule := func(ctx context.Context, guard clientv3.Cmp) { <-ctx.Done() }
	terms := make(chan int64) // each term's token, for the example to follow
	go func() {
		defer close(terms)
		for {
			if err := e.Campaign(ctx, "node-1"); err != nil {
				fmt.Println("no longer campaigning:", errors.Is(err, coord.ErrClosed))
				return
			}
			work, stop := context.WithCancel(ctx)
			go schedule(work, e.Guard())
			terms <- e.Token()
			select {
			case <-e.Done():
				fmt.Println("leadership ended:", e.Err())
			case <-ctx.Done():
			}
			stop()
		}
	}()
	next := func() int64 {
		select {
		case token := <-terms:
			return token
		case <-time.After(exampleWait):
			log.Fatal("no new term")
		}
		panic("unreachable")
	}
	first := next()
	if _, err := cli.Delete(ctx, "/coord/elections/scheduler/", clientv3.WithPrefix()); err != nil {
		log.Fatal(err)
	}
	fmt.Println("leads again, with a higher token:", next() > first)
	e.Close()
	_, open := <-terms
	fmt.Println("loop returned:", !open)

	// Output:
	// leadership ended: coord: leadership lost: leader key deleted
	// leads again, with a higher token: true
	// leadership ended: coord: closed
	// no longer campaigning: true
	// loop returned: true
}

func ExampleElection_Observe() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	join := func(identity string) *coord.Election {
		e, err := coord.NewElection(ctx, cli, coord.ElectionOptions{
			Key: "/coord/elections/scheduler", TTL: time.Second, Identity: identity,
		})
		if err != nil {
			log.Fatal(err)
		}
		return e
	}
	n1 := join("node-1")
	defer n1.Close()
	n2 := join("node-2")
	defer n2.Close()

	// Any member can follow the leader, candidate or not: first the
	// current leader ("" for none), then each change.
	octx, ocancel := context.WithCancel(ctx)
	defer ocancel()
	obs := n2.Observe(octx)
	show := func() {
		switch leader, ok := exampleLeader(obs); {
		case !ok:
			fmt.Println("observer closed")
		case leader == "":
			fmt.Println("leader: none")
		default:
			fmt.Println("leader:", leader)
		}
	}
	show()

	if err := n1.Campaign(ctx, ""); err != nil {
		log.Fatal(err)
	}
	show()
	if err := n1.Resign(ctx); err != nil {
		log.Fatal(err)
	}
	show()
	if err := n2.Campaign(ctx, ""); err != nil {
		log.Fatal(err)
	}
	show()

	// The channel closes when the observer's ctx ends (or on Close).
	ocancel()
	show()

	// Output:
	// leader: none
	// leader: node-1
	// leader: none
	// leader: node-2
	// observer closed
}

func ExampleElectionPool() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	// One pool per agent: its elections share its sessions (up to
	// KeysPerSession keys on one lease), owned by the pool.
	pool, err := coord.NewElectionPool(cli, coord.PoolOptions{TTL: time.Second, Identity: "node-1"})
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	other, err := coord.NewElectionPool(cli, coord.PoolOptions{TTL: time.Second, Identity: "node-2"})
	if err != nil {
		log.Fatal(err)
	}
	defer other.Close()

	keys := []string{"/coord/elections/billing", "/coord/elections/scheduler"}
	held := map[string]*coord.Election{}
	for _, key := range keys {
		e, err := pool.Election(ctx, key)
		if err != nil {
			log.Fatal(err)
		}
		held[key] = e
		won, err := e.TryCampaign(ctx, "") // "" proclaims the pool's Identity
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println("node-1 leads", key+":", won)
	}
	e2, err := other.Election(ctx, keys[1])
	if err != nil {
		log.Fatal(err)
	}
	won, err := e2.TryCampaign(ctx, "")
	if err != nil {
		log.Fatal(err)
	}
	leader, err := e2.Leader(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("node-2 leads", keys[1]+":", won, "- leader is", leader)

	// One holder per key, until its Close.
	_, err = pool.Election(ctx, keys[1])
	fmt.Println("held:", errors.Is(err, coord.ErrInUse))
	st := pool.Stats()
	fmt.Printf("elections=%d sessions=%d leading=%d ttl=%v\n", st.Elections, st.Sessions, st.Leading, st.TTL)

	// Close resigns and releases the key: the other agent can lead it.
	held[keys[1]].Close()
	if err := e2.Campaign(ctx, ""); err != nil {
		log.Fatal(err)
	}
	fmt.Println("node-2 leads", keys[1]+":", e2.IsLeader())

	// The pool's Close closes every election and revokes its sessions.
	if err := pool.Close(); err != nil {
		log.Fatal(err)
	}
	_, err = pool.Election(ctx, keys[0])
	fmt.Println("closed:", pool.Stats().Closed, "still leading:", held[keys[0]].IsLeader(), "ErrClosed:", errors.Is(err, coord.ErrClosed))

	// Output:
	// node-1 leads /coord/elections/billing: true
	// node-1 leads /coord/elections/scheduler: true
	// node-2 leads /coord/elections/scheduler: false - leader is node-1
	// held: true
	// elections=2 sessions=1 leading=2 ttl=1s
	// node-2 leads /coord/elections/scheduler: true
	// closed: true still leading: false ErrClosed: true
}

func ExampleSemaphore() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	// Rolling maintenance: at most two hosts at once. Every host joins the
	// same semaphore, with the same Limit.
	join := func(host string) *coord.Semaphore {
		s, err := coord.NewSemaphore(ctx, cli, coord.SemaphoreOptions{Key: "/coord/semaphores/maintenance", Limit: 2, TTL: time.Second, Identity: host})
		if err != nil {
			log.Fatal(err)
		}
		return s
	}
	a, b, c := join("node-1"), join("node-2"), join("node-3")
	defer a.Close()
	defer b.Close()
	defer c.Close()
	pa, err := a.Acquire(ctx)
	if err != nil {
		log.Fatal(err)
	}
	pb, err := b.Acquire(ctx)
	if err != nil {
		log.Fatal(err)
	}
	_, err = c.TryAcquire(ctx)
	fmt.Println("node-3 waits:", errors.Is(err, coord.ErrNoPermit))
	holders, err := c.Holders(ctx)
	if err != nil {
		log.Fatal(err)
	}
	for _, h := range holders {
		fmt.Println("holder:", h.Identity)
	}

	// Work on etcd is fenced: a write under Guard applies only while the
	// permit is held.
	write := func(p *coord.Permit) bool {
		resp, err := cli.Txn(ctx).If(p.Guard()).Then(clientv3.OpPut("/maintenance/log", "draining")).Commit()
		if err != nil {
			log.Fatal(err)
		}
		return resp.Succeeded
	}
	fmt.Println("guarded write while holding:", write(pa))

	// Released, the permit goes to the next in line.
	if err := pa.Release(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Println("released:", errors.Is(pa.Err(), coord.ErrReleased), "guarded write after:", write(pa))
	pc, err := c.Acquire(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("node-3 holds, tokens increase:", pc.Token() > pb.Token())

	// Another Limit on the same key is refused, and writes nothing.
	_, err = coord.NewSemaphore(ctx, cli, coord.SemaphoreOptions{Key: "/coord/semaphores/maintenance", Limit: 3})
	fmt.Println("limit mismatch:", errors.Is(err, coord.ErrLimitMismatch))

	// Output:
	// node-3 waits: true
	// holder: node-1
	// holder: node-2
	// guarded write while holding: true
	// released: true guarded write after: false
	// node-3 holds, tokens increase: true
	// limit mismatch: true
}

func ExampleHealthHandler() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	h, err := coord.RegisterHostLiveness(ctx, cli, coord.HostMetadata{HostUUID: "3f1c"}, coord.LivenessOptions{TTL: time.Second})
	if err != nil {
		log.Fatal(err)
	}
	defer h.Stop(context.Background())
	w, err := coord.NewHostWatcher(ctx, cli, coord.WatcherOptions{})
	if err != nil {
		log.Fatal(err)
	}
	defer w.Close()
	exampleEvent(w) // listed: the watcher follows etcd

	// An agent mounts it with http.Handle("/readyz", ...).
	srv := httptest.NewServer(coord.HealthHandler(map[string]coord.Checker{"liveness": h, "hosts": w}))
	defer srv.Close()
	get := func(path string) {
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			log.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		fmt.Printf("%d %s", resp.StatusCode, body)
	}
	get("/readyz?verbose")
	if err := h.Stop(ctx); err != nil {
		log.Fatal(err)
	}
	get("/readyz")

	// Output:
	// 200 [+]hosts ok
	// [+]liveness ok
	// healthz check passed
	// 503 liveness: coord: host "3f1c": stopped
}
