package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-coord/coord"
	"github.com/go-coord/coord/coordtest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// uiEvil is host metadata that a page that does not escape it would run.
const uiEvil = `<script>document.title="pwned"</script><img src=x onerror="document.title='pwned'">`

// uiFleet is a fleet for coord ui to show, on an embedded etcd: hosts
// (one with hostile metadata), an election with a leader and a candidate
// in line, a ShardSet of two members and a semaphore with a holder and a
// waiter; and coord ui serving it.
type uiFleet struct {
	srv      *coordtest.Server
	ep       string
	hosts    map[string]*coord.HostLiveness // by HostUUID
	leader   *coord.Election                // leads /coord/elections/scheduler as leader-1
	next     *coord.Election                // in line behind it, as leader-2
	nextLeds chan error                     // the outcome of next's Campaign
	sets     map[string]*coord.ShardSet     // the shard set's members, by HostUUID
	ui       *bgCoord
	url      string // the page's
}

const uiTestElection = "/coord/elections/scheduler"

func newUIFleet(t *testing.T) *uiFleet {
	t.Helper()
	srv, ep, _ := newEtcd(t)
	f := &uiFleet{srv: srv, ep: ep, hosts: map[string]*coord.HostLiveness{}, nextLeds: make(chan error, 1),
		sets: map[string]*coord.ShardSet{}}
	for _, m := range []coord.HostMetadata{
		{HostUUID: "host-a", Hostname: "node-a", Version: "1.2.3", Labels: map[string]string{"zone": "z1"}},
		{HostUUID: "host-b", Hostname: "node-b", Labels: map[string]string{"zone": "z2"}},
		{HostUUID: "host-c", Hostname: "node-c"},
		{HostUUID: "host-evil", Hostname: uiEvil, Labels: map[string]string{"note": uiEvil}},
	} {
		f.hosts[m.HostUUID] = register(t, srv.NewClient(t), m, coord.LivenessOptions{TTL: uiFleetTTL})
	}
	ctx := tctx(t)
	var err error
	if f.leader, err = coord.NewElection(ctx, srv.NewClient(t), coord.ElectionOptions{Key: uiTestElection}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.leader.Close() })
	if err := f.leader.Campaign(ctx, "leader-1"); err != nil {
		t.Fatal(err)
	}
	if f.next, err = coord.NewElection(ctx, srv.NewClient(t), coord.ElectionOptions{Key: uiTestElection}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.next.Close(); <-f.nextLeds })
	go func() { f.nextLeds <- f.next.Campaign(context.Background(), "leader-2") }()
	f.startShards(t, "host-a", "host-b")
	f.startSemaphore(t, "sem-1", "sem-2")
	f.waitKeys(t, uiTestElection+"/", 2)
	f.ui = startCoord(t, "ui", "--endpoints", ep, "--listen", "127.0.0.1:0")
	f.ui.waitOutput(t, f.ui.stderr, "serving the fleet's page at ")
	f.url = strings.Fields(strings.SplitAfter(f.ui.stderr.String(), "page at ")[1])[0]
	return f
}

// startShards runs a ShardSet of four shards on the given hosts, and
// waits until every shard is owned by the host that ranks first for it,
// with a standby: no move in flight.
func (f *uiFleet) startShards(t *testing.T, hosts ...string) {
	t.Helper()
	for _, id := range hosts {
		set, err := coord.NewShardSet(tctx(t), f.srv.NewClient(t), coord.ShardOptions{
			Shards: []string{"s1", "s2", "s3", "s4"}, Host: f.hosts[id], TTL: uiFleetTTL, Settle: 10 * time.Millisecond,
			Run: func(ctx context.Context, s coord.Shard) { <-ctx.Done() },
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { set.Close() })
		f.sets[id] = set
	}
	eventually(t, "every shard owned by its first-ranked host, with a standby", func() bool {
		shards, err := listShards(tctx(t), f.srv.Client(), coord.ShardsPrefix, coord.HostsPrefix, io.Discard)
		return err == nil && len(shards) == 4 && !slices.ContainsFunc(shards, func(s shardInfo) bool {
			return len(s.Standbys) != 1 || s.Owner.Identity != coord.RankHosts(s.Shard, hosts)[0]
		})
	})
}

// startSemaphore has the first identity hold the one permit of
// /coord/semaphores/maintenance, the second wait in line for it.
func (f *uiFleet) startSemaphore(t *testing.T, holder, waiter string) {
	t.Helper()
	var wg sync.WaitGroup
	for i, id := range []string{holder, waiter} {
		s, err := coord.NewSemaphore(tctx(t), f.srv.NewClient(t), coord.SemaphoreOptions{Key: "/coord/semaphores/maintenance", Limit: 1, Identity: id})
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() { s.Acquire(context.Background()) }) // until Close
		t.Cleanup(func() { s.Close(); wg.Wait() })
		f.waitKeys(t, "/coord/semaphores/maintenance/", i+1)
	}
}

// waitKeys waits until n keys are under prefix.
func (f *uiFleet) waitKeys(t *testing.T, prefix string, n int) {
	t.Helper()
	eventually(t, "keys under "+prefix, func() bool {
		resp, err := f.srv.Client().Get(tctx(t), prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
		return err == nil && resp.Count == int64(n)
	})
}

// get returns the body of a GET of the page's path.
func (f *uiFleet) get(t *testing.T, path string) string {
	t.Helper()
	resp, err := http.Get(f.url + strings.TrimPrefix(path, "/"))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s, %v\n%s", path, resp.Status, err, b)
	}
	return string(b)
}

func TestUI(t *testing.T) {
	t.Parallel()
	f := newUIFleet(t)

	t.Run("the first page holds the whole state: hosts, leader, shards, semaphores, metadata escaped", func(t *testing.T) {
		page := f.get(t, "/")
		for _, want := range []string{
			`data-host="host-a"`, "node-a", "1.2.3", "zone=z1", "of 5s", `data-host="host-c"`,
			`data-election="` + uiTestElection + `"`, `<td class="leader" title="leader-1">leader-1</td>`, "leader-2",
			`<td title="host-a">node-a</td>`, `<td title="host-b">node-b</td>`, `<td class="owner" title="host-`,
			`data-shard="s1"`, `data-shard="s4"`, `data-member="host-a"`, `data-member="host-b"`,
			`data-semaphore="/coord/semaphores/maintenance"`, "sem-1 (", "sem-2",
			"&lt;script&gt;document.title=&#34;pwned&#34;&lt;/script&gt;",
		} {
			if !strings.Contains(page, want) {
				t.Errorf("the page lacks %q", want)
			}
		}
		if strings.Contains(page, "<script>document.title") || strings.Contains(page, "<img src=x") {
			t.Errorf("the page holds the metadata unescaped:\n%s", page)
		}
		if t.Failed() {
			t.Logf("page:\n%s", page)
		}
	})

	t.Run("/state: the view as JSON; every shard owned by a member, none moving", func(t *testing.T) {
		var v uiView
		if err := json.Unmarshal([]byte(f.get(t, "/state")), &v); err != nil {
			t.Fatal(err)
		}
		if len(v.Hosts) != 4 || len(v.Elections) != 1 || v.Elections[0].Leader.Identity != "leader-1" ||
			len(v.Shards.Shards) != 4 || len(v.Shards.Members) != 2 || v.Shards.Moving != 0 || len(v.Semaphores) != 1 {
			t.Fatalf("view: %+v", v)
		}
		for _, s := range v.Shards.Shards {
			if s.Owner.Identity != "host-a" && s.Owner.Identity != "host-b" {
				t.Errorf("shard %s: owner %q", s.Shard, s.Owner.Identity)
			}
		}
		if s := v.Semaphores[0]; s.Limit != 1 || len(s.Holders) != 1 || s.Holders[0].Identity != "sem-1" || len(s.Waiters) != 1 {
			t.Errorf("semaphore: %+v", s)
		}
	})

	t.Run("the event stream delivers a Down at once, then a leader change", func(t *testing.T) {
		ev := openEvents(t, f.url)
		ev.until(t, "the first view", func(v uiView) bool { return len(v.Hosts) == 4 })
		start := time.Now()
		if err := f.hosts["host-c"].Stop(tctx(t)); err != nil {
			t.Fatal(err)
		}
		ev.until(t, "host-c down", func(v uiView) bool { return hostDown(v, "host-c") })
		t.Logf("host-c: Stop -> down in the event stream %v", time.Since(start))
		start = time.Now()
		if err := f.leader.Resign(tctx(t)); err != nil {
			t.Fatal(err)
		}
		ev.until(t, "leader-2 leads", func(v uiView) bool {
			return len(v.Elections) == 1 && v.Elections[0].Leader.Identity == "leader-2" && len(v.Elections[0].Queue) == 0
		})
		t.Logf("Resign -> the new leader in the event stream %v", time.Since(start))
		if d := time.Since(start); d > time.Second*scale {
			t.Errorf("the new leader took %v", d)
		}
	})

	t.Run("an etcd restart does not wedge it: a change after it shows", func(t *testing.T) {
		ev := openEvents(t, f.url)
		ev.until(t, "the first view", func(v uiView) bool { return len(v.Hosts) > 0 })
		f.srv.Restart()
		e, err := coord.NewElection(tctx(t), f.srv.NewClient(t), coord.ElectionOptions{Key: "/coord/elections/after-restart"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.Close() })
		if err := e.Campaign(tctx(t), "restarted"); err != nil {
			t.Fatal(err)
		}
		ev.until(t, "the election begun after the restart", func(v uiView) bool {
			return slices.ContainsFunc(v.Elections, func(e uiElection) bool { return e.Leader.Identity == "restarted" })
		})
	})

	t.Run("interrupted, it ends: event streams closed, server shut down", func(t *testing.T) {
		ev := openEvents(t, f.url)
		ev.until(t, "the first view", func(v uiView) bool { return true })
		r := f.ui.stop(t)
		if r.code != exitOK {
			t.Fatalf("status %d, stderr %q", r.code, r.stderr)
		}
		ev.closed(t)
		if resp, err := http.Get(f.url); err == nil {
			resp.Body.Close()
			t.Fatalf("the page is still served: %s", resp.Status)
		}
	})
}

func hostDown(v uiView, id string) bool {
	return slices.ContainsFunc(v.Hosts, func(h uiHost) bool { return h.HostUUID == id && h.Down })
}

// uiEvents is a client of /events: the views it delivers.
type uiEvents struct {
	views chan uiView // closed when the stream ends
	body  io.Closer
}

func openEvents(t *testing.T, url string) *uiEvents {
	t.Helper()
	resp, err := http.Get(url + "events")
	if err != nil {
		t.Fatal(err)
	}
	if ct := resp.Header.Get("Content-Type"); resp.StatusCode != http.StatusOK || ct != "text/event-stream" {
		t.Fatalf("GET /events: %s, %s", resp.Status, ct)
	}
	ev := &uiEvents{views: make(chan uiView), body: resp.Body}
	stop := make(chan struct{})
	done := make(chan struct{})
	t.Cleanup(func() {
		close(stop)
		resp.Body.Close()
		<-done
	})
	go func() {
		defer close(done)
		defer close(ev.views)
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			data, ok := strings.CutPrefix(sc.Text(), "data: ")
			var v uiView
			if !ok || json.Unmarshal([]byte(data), &v) != nil {
				continue
			}
			select {
			case ev.views <- v:
			case <-stop:
				return
			}
		}
	}()
	return ev
}

// until waits, within waitLimit, for a view for which cond holds.
func (e *uiEvents) until(t *testing.T, what string, cond func(uiView) bool) uiView {
	t.Helper()
	deadline := time.After(waitLimit)
	for {
		select {
		case v, ok := <-e.views:
			if !ok {
				t.Fatalf("%s: the event stream ended", what)
			}
			if cond(v) {
				return v
			}
		case <-deadline:
			t.Fatalf("%s: not in the event stream within %v", what, waitLimit)
		}
	}
}

// closed waits, within waitLimit, for the stream to end.
func (e *uiEvents) closed(t *testing.T) {
	t.Helper()
	deadline := time.After(waitLimit)
	for {
		select {
		case _, ok := <-e.views:
			if !ok {
				return
			}
		case <-deadline:
			t.Fatalf("the event stream still open %v after the command ended", waitLimit)
		}
	}
}

func TestUIShardMoves(t *testing.T) {
	// Two hosts, both live members; for each shard, the line as etcd
	// would hold it.
	st := newUIState(coord.ShardsPrefix)
	now := time.Now()
	for _, id := range []string{"h1", "h2"} {
		st.noteHost(coord.HostEvent{Kind: coord.HostUp, HostUUID: id, Metadata: coord.HostMetadata{HostUUID: id}}, now)
		st.members[id] = coord.ShardMember{HostUUID: id, Weight: 1}
	}
	best := coord.RankHosts("s", []string{"h1", "h2"})
	line := func(owner, standby string) shardInfo {
		return shardInfo{Shard: "s", Owner: shardCandidate{Identity: owner}, Standbys: []shardCandidate{{Identity: standby}}}
	}
	moving := func() string {
		st.mu.Lock()
		defer st.mu.Unlock()
		v, _ := st.shardsViewLocked()
		if n := len(v.Shards[0].Moving) / max(1, len(v.Shards[0].Moving)); v.Moving != n {
			t.Errorf("%d moves in flight, want %d", v.Moving, n)
		}
		return v.Shards[0].Moving
	}
	st.shards = []shardInfo{line(best[0], best[1])}
	if m := moving(); m != "" {
		t.Errorf("owned by the best-ranked member: moving %q", m)
	}
	st.shards = []shardInfo{line(best[1], best[0])}
	if m := moving(); m != "to "+best[0] {
		t.Errorf("the best-ranked member in line behind the owner: moving %q, want to %s", m, best[0])
	}
	st.members[best[0]] = coord.ShardMember{HostUUID: best[0], Weight: 1, Draining: true}
	if m := moving(); m != "" {
		t.Errorf("the member in line drains: moving %q", m)
	}
	st.noteHost(coord.HostEvent{Kind: coord.HostDown, HostUUID: best[1], Metadata: coord.HostMetadata{HostUUID: best[1]}}, now)
	if m := moving(); m != "failover: owner down" {
		t.Errorf("the owner's host down: moving %q", m)
	}
}

// startUI serves coord ui of the etcd at ep with args, and returns it
// with the page's URL.
// uiStateOf returns the view that the page at url serves as /state.
func uiStateOf(t *testing.T, url string) uiView {
	t.Helper()
	_, body := getAs(t, url+"state", "127.0.0.1")
	var v uiView
	if err := json.Unmarshal([]byte(body), &v); err != nil {
		t.Fatalf("/state: %v\n%s", err, body)
	}
	return v
}

func startUI(t *testing.T, ep string, args ...string) (*bgCoord, string) {
	t.Helper()
	ui := startCoord(t, append([]string{"ui", "--endpoints", ep, "--listen", "127.0.0.1:0"}, args...)...)
	ui.waitOutput(t, ui.stderr, "serving the fleet's page at ")
	return ui, strings.Fields(strings.SplitAfter(ui.stderr.String(), "page at ")[1])[0]
}

// getAs returns the status and body of a GET of url with Host header host.
func getAs(t *testing.T, url, host string) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(tctx(t), http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Host = host
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestUIHardening(t *testing.T) {
	t.Run("a Host that is a name is refused unless --allow-host lists it; addresses and localhost are served", func(t *testing.T) {
		_, ep, _ := newEtcd(t)
		_, url := startUI(t, ep, "--allow-host", "Coord.Example, ops.internal")
		port := url[strings.LastIndex(url, ":")+1 : len(url)-1]
		for host, want := range map[string]int{
			"127.0.0.1:" + port:        http.StatusOK,
			"[::1]:" + port:            http.StatusOK,
			"localhost:" + port:        http.StatusOK,
			"LOCALHOST":                http.StatusOK,
			"coord.example:" + port:    http.StatusOK,
			"ops.internal":             http.StatusOK,
			"attacker.example:" + port: http.StatusMisdirectedRequest,
			"127.0.0.1.nip.io":         http.StatusMisdirectedRequest,
		} {
			for _, path := range []string{"", "state", "events"} {
				if path == "events" && want == http.StatusOK {
					continue // a stream: it does not end
				}
				if got, body := getAs(t, url+path, host); got != want {
					t.Errorf("GET /%s with Host %q: %d, want %d: %s", path, host, got, want, body)
				}
			}
		}
	})

	t.Run("the page's own script and style, by hash, are all the CSP lets run", func(t *testing.T) {
		_, ep, _ := newEtcd(t)
		_, url := startUI(t, ep)
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		csp := resp.Header.Get("Content-Security-Policy")
		for _, tag := range [][2]string{{"<script>", "</script>"}, {"<style>", "</style>"}} {
			if h := inlineHash(string(body), tag[0], tag[1]); !strings.Contains(csp, h) {
				t.Errorf("CSP %q lacks the hash %s of the %s served", csp, h, tag[0])
			}
		}
		if strings.Contains(csp, "unsafe-inline") || strings.Count(string(body), "<script") != 1 {
			t.Errorf("CSP %q, %d scripts", csp, strings.Count(string(body), "<script"))
		}
	})

	t.Run("an /events client that reads nothing does not hold the shutdown back", func(t *testing.T) {
		_, ep, cli := newEtcd(t)
		// A state of about 1 MB: a few events fill the connection's
		// buffers, and the stream's writes block.
		big := strings.Repeat("x", 16<<10)
		var hosts []*coord.HostLiveness
		for i := range 64 {
			hosts = append(hosts, register(t, cli, coord.HostMetadata{HostUUID: fmt.Sprintf("host-%02d", i),
				Labels: map[string]string{"big": big}}, coord.LivenessOptions{TTL: 5 * time.Second}))
		}
		ui, url := startUI(t, ep)
		conn, err := net.Dial("tcp", strings.TrimSuffix(strings.TrimPrefix(url, "http://"), "/"))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		if _, err := fmt.Fprintf(conn, "GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		// Changes, each an event of the whole state, that nobody reads.
		for i := range 16 {
			m := coord.HostMetadata{HostUUID: "host-00", Version: fmt.Sprintf("v%d", i), Labels: map[string]string{"big": big}}
			if err := hosts[0].Update(tctx(t), m); err != nil {
				t.Fatal(err)
			}
			eventually(t, "the page at the update", func() bool {
				_, body := getAs(t, url+"state", "127.0.0.1")
				return strings.Contains(body, fmt.Sprintf(`"version": "v%d"`, i))
			})
		}
		res := ui.stop(t)
		if res.code != 0 || strings.Contains(res.stderr, "shut down") {
			t.Fatalf("coord ui exited %d after %v:\n%s", res.code, res.took, res.stderr)
		}
	})
}

func TestUIEtcdUnreachable(t *testing.T) {
	srv, ep, _ := newEtcd(t)
	_, url := startUI(t, ep)
	state := func() uiView { return uiStateOf(t, url) }
	eventually(t, "etcd answering", func() bool {
		v := state()
		return !v.Stale && strings.HasPrefix(v.Etcd, "etcd last answered at ")
	})
	srv.Stop()
	stopped := time.Now()
	eventually(t, "the page saying etcd is unreachable", func() bool {
		v := state()
		return v.Stale && strings.HasPrefix(v.Etcd, "etcd unreachable since ")
	})
	t.Logf("stale %v after etcd stopped", time.Since(stopped).Round(time.Millisecond))
	if _, page := getAs(t, url, "127.0.0.1"); !strings.Contains(page, `<body class="stale">`) || !strings.Contains(page, `<p id="etcd" class="stale">etcd unreachable since `) {
		t.Fatalf("the page does not say etcd is unreachable:\n%s", page)
	}
	srv.Restart()
	restarted := time.Now()
	eventually(t, "the page live again", func() bool { return !state().Stale })
	t.Logf("live %v after etcd restarted", time.Since(restarted).Round(time.Millisecond))
}

func TestUIEtcdReplaced(t *testing.T) {
	srv, ep, cli := newEtcd(t)
	for i := range 20 {
		if _, err := cli.Put(tctx(t), fmt.Sprintf("/elsewhere/%d", i), "x"); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := cli.Put(tctx(t), "/coord/elections/old/1", "old-leader"); err != nil {
		t.Fatal(err)
	}
	_, url := startUI(t, ep)
	elections := func() []string {
		var out []string
		for _, e := range uiStateOf(t, url).Elections {
			out = append(out, e.Key+"="+e.Leader.Identity)
		}
		return out
	}
	if got := elections(); !slices.Equal(got, []string{"/coord/elections/old=old-leader"}) {
		t.Fatalf("elections %v", got)
	}
	srv.Replace()
	replaced := time.Now()
	eventually(t, "the new etcd answering", func() bool {
		_, err := cli.Put(tctx(t), "/coord/elections/new/1", "new-leader")
		return err == nil
	})
	eventually(t, "the page showing the new etcd's elections only", func() bool {
		return slices.Equal(elections(), []string{"/coord/elections/new=new-leader"})
	})
	t.Logf("the page matched the new etcd %v after it replaced the old", time.Since(replaced).Round(time.Millisecond))
	if _, body := getAs(t, url+"state", "127.0.0.1"); !strings.Contains(body, "etcd replaced or restored at ") {
		t.Fatalf("/state does not say etcd was replaced:\n%s", body)
	}
}

// TestUIOverview checks what an operator looks for first: how many hosts
// are live and down, the down ones listed first, what each leads, owns
// and holds (by its UUID or its hostname), each member's share of
// the shards next to its weight's, and warnings for a shard without a
// standby and a member owning far more than its weight's share.
func TestUIOverview(t *testing.T) {
	st := newUIState(coord.ShardsPrefix)
	now := time.Now()
	for _, id := range []string{"h1", "h2", "h3", "h4"} {
		st.noteHost(coord.HostEvent{Kind: coord.HostUp, HostUUID: id, Metadata: coord.HostMetadata{HostUUID: id, Hostname: "node-" + id}}, now)
	}
	st.noteHost(coord.HostEvent{Kind: coord.HostDown, HostUUID: "h4", Metadata: coord.HostMetadata{HostUUID: "h4"}}, now)
	for _, id := range []string{"h1", "h2", "h3"} {
		st.members[id] = coord.ShardMember{HostUUID: id, Weight: 1}
	}
	// h1 owns 5 of 6 shards (its share is a third), h2 one; one shard
	// has no standby.
	for i := range 6 {
		owner, standby := "h1", []shardCandidate{{Identity: "h2"}}
		if i == 5 {
			owner = "h2"
		}
		if i == 0 {
			standby = nil
		}
		st.shards = append(st.shards, shardInfo{Shard: fmt.Sprintf("s%d", i), Owner: shardCandidate{Identity: owner}, Standbys: standby})
	}
	st.elections = []uiElection{{Key: "/coord/elections/e", Leader: permitInfo{Identity: "node-h1"}}}
	st.sems = []semaphoreInfo{{Key: "/coord/semaphores/m", Limit: 1, Holders: []permitInfo{{Identity: "h2"}}}}
	v, _ := st.view()
	roles := map[string]string{}
	for _, h := range v.Hosts {
		roles[h.HostUUID] = h.Roles
	}
	if want := map[string]string{"h1": "leads /coord/elections/e; owns 5 shards", "h2": "owns 1 shard; holds a permit of /coord/semaphores/m", "h3": "", "h4": ""}; !maps.Equal(roles, want) {
		t.Errorf("roles %q, want %q", roles, want)
	}
	if v.Live != 3 || v.Down != 1 || len(v.Hosts) != 4 || v.Hosts[0].HostUUID != "h4" || v.Hosts[1].HostUUID != "h1" {
		t.Fatalf("live %d, down %d, hosts in order %v; want 3, 1, h4 first then by UUID", v.Live, v.Down, v.Hosts)
	}
	want := []string{"shard s0 has no standby", "node-h1 owns 83% of 6 (weight: 33%)"}
	if !slices.Equal(v.Warnings, want) {
		t.Fatalf("warnings %q, want %q", v.Warnings, want)
	}
	shares := map[string]string{}
	for _, m := range v.Shards.Members {
		shares[m.HostUUID] = m.Share
	}
	if shares["h2"] != "17% of 6 (weight: 33%)" || shares["h3"] != "0% of 6 (weight: 33%)" {
		t.Fatalf("shares %v", shares)
	}

	// Each member's state, and its lease's time left, marked when a
	// renewal is overdue.
	st.noteHost(coord.HostEvent{Kind: coord.HostUp, HostUUID: "h5", Metadata: coord.HostMetadata{HostUUID: "h5"}}, now)
	st.members["h4"] = coord.ShardMember{HostUUID: "h4", Weight: 1}
	st.members["h5"] = coord.ShardMember{HostUUID: "h5", Weight: 1, Draining: true}
	st.noteTTLs([]liveHost{{HostMetadata: coord.HostMetadata{HostUUID: "h1"}, Lease: "1", TTLLeft: 1, GrantedTTL: 6},
		{HostMetadata: coord.HostMetadata{HostUUID: "h2"}, Lease: "2", TTLLeft: 3, GrantedTTL: 6}}, now.Add(time.Second))
	// A shard h1 owns, for which h3 stands by and ranks first: it moves
	// to h3, which owns nothing yet.
	for i := 0; ; i++ {
		name := fmt.Sprintf("j%d", i)
		if coord.RankMembers(name, []coord.ShardMember{st.members["h1"], st.members["h3"]})[0].HostUUID == "h3" {
			st.shards = append(st.shards, shardInfo{Shard: name, Owner: shardCandidate{Identity: "h1"}, Standbys: []shardCandidate{{Identity: "h3"}}})
			break
		}
	}
	v, _ = st.view()
	states := map[string]string{}
	for _, m := range v.Shards.Members {
		states[m.HostUUID] = fmt.Sprintf("%s %s %v", m.State, m.TTL, m.Late)
	}
	if want := map[string]string{"h1": "active 1s of 6s true", "h2": "active 3s of 6s false", "h3": "joining  false",
		"h4": "down  false", "h5": "leaving  false"}; !maps.Equal(states, want) {
		t.Errorf("members' states %q, want %q", states, want)
	}
	// h2 (owning s5) drains: it is draining until it owns nothing.
	st.members["h2"] = coord.ShardMember{HostUUID: "h2", Weight: 1, Draining: true}
	if v, _ = st.view(); v.Shards.Members[1].State != "draining" {
		t.Errorf("a draining member that owns a shard: %q, want draining", v.Shards.Members[1].State)
	}
}

// TestUIStopCrashAndTakeover checks that the page tells a clean stop from
// a crash (the lease revoked before it could expire, or left to expire),
// and says when each leader took over: before the page started, or when
// it saw it.
func TestUIStopCrashAndTakeover(t *testing.T) {
	t.Parallel()
	srv, ep, _ := newEtcd(t)
	// The stopped host's TTL leaves its lease seconds of life at each
	// read; the crashed one's expires soon after its client goes.
	stopped := register(t, srv.NewClient(t), coord.HostMetadata{HostUUID: "host-stops"}, coord.LivenessOptions{TTL: 10 * time.Second})
	crashCli := srv.NewClient(t)
	register(t, crashCli, coord.HostMetadata{HostUUID: "host-crashes"}, coord.LivenessOptions{TTL: 2 * time.Second})
	var leaders []*coord.Election
	for _, id := range []string{"first", "second"} {
		e, err := coord.NewElection(tctx(t), srv.NewClient(t), coord.ElectionOptions{Key: uiTestElection})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.Close() })
		leaders = append(leaders, e)
		if id == "first" {
			if err := e.Campaign(tctx(t), id); err != nil {
				t.Fatal(err)
			}
			continue
		}
		led := make(chan error, 1)
		go func() { led <- e.Campaign(context.Background(), id) }()
		t.Cleanup(func() { e.Close(); <-led })
	}
	_, url := startUI(t, ep)
	state := func() uiView { return uiStateOf(t, url) }
	down := func(id string) (string, bool) {
		for _, h := range state().Hosts {
			if h.HostUUID == id {
				return h.DownHow, h.Down
			}
		}
		return "", false
	}
	since := func() (string, string) {
		es := state().Elections
		if len(es) != 1 {
			t.Fatalf("elections %v, want one", es)
		}
		return es[0].Leader.Identity, es[0].Since
	}
	if who, when := since(); who != "first" || !strings.HasPrefix(when, "before ") {
		t.Errorf("leader %q since %q: want first, since before the page started", who, when)
	}

	if err := stopped.Stop(tctx(t)); err != nil {
		t.Fatal(err)
	}
	crashCli.Close()
	crashed := time.Now()
	for id, want := range map[string]string{"host-stops": "stopped", "host-crashes": "lease expired"} {
		eventually(t, id+" down", func() bool { _, d := down(id); return d })
		if how, _ := down(id); how != want {
			t.Errorf("%s went %q, want %q", id, how, want)
		}
	}
	t.Logf("the crashed host shown down %v after its client closed", time.Since(crashed).Round(time.Millisecond))

	resigned := time.Now()
	if err := leaders[0].Resign(tctx(t)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "second leading", func() bool { who, _ := since(); return who == "second" })
	_, when := since()
	clock, err := time.ParseInLocation(timestamp, when, time.Local)
	if err != nil {
		t.Fatalf("second leads since %q: %v", when, err)
	}
	// The page gives the time of day, to the millisecond.
	r := resigned.Truncate(time.Millisecond)
	at := time.Date(r.Year(), r.Month(), r.Day(), clock.Hour(), clock.Minute(), clock.Second(), clock.Nanosecond(), r.Location())
	if at.Before(r.Add(-12 * time.Hour)) {
		at = at.AddDate(0, 0, 1) // past midnight
	}
	if d := at.Sub(r); d < 0 || at.After(time.Now()) {
		t.Errorf("second leads since %s, %v after the resign at %s: want between the resign and now", when, d, r.Format(timestamp))
	}
}
