package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/go-coord/coord"
	"github.com/go-coord/coord/coordtest"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
)

// benchEnv is what the scenarios share: the etcd, a client for the
// watchers and bookkeeping, and a key prefix of their own.
type benchEnv struct {
	cli      *clientv3.Client // shared: watchers, successors, setup
	base     clientv3.Config  // for the clients a scenario creates
	root     string           // every key of the run lives under it
	desc     string           // what etcd this is, for the header
	embedded bool
	log      io.Writer
	logMu    sync.Mutex
	started  time.Time

	srv *coordtest.Standalone // nil against --endpoints
	dir string                // the embedded etcd's data

	mu      sync.Mutex
	clients []*clientv3.Client // closed by close
}

func newBenchEnv(ctx context.Context, cfg Config) (_ *benchEnv, err error) {
	env := &benchEnv{log: cfg.Progress, started: time.Now(), root: fmt.Sprintf("/coord-bench/%08x/", rand.Uint32())}
	if env.log == nil {
		env.log = io.Discard
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, env.close())
		}
	}()
	if cfg.Etcd == nil {
		if env.dir, err = benchTempDir(); err != nil {
			return nil, fmt.Errorf("bench: %w", err)
		}
		env.progress("starting an embedded etcd in %s", env.dir)
		if env.srv, err = coordtest.Start(env.dir, coordtest.Config{}); err != nil {
			return nil, fmt.Errorf("bench: %w", err)
		}
		env.base = env.srv.ClientConfig()
		env.embedded = true
		env.desc = benchEmbeddedDesc()
	} else {
		env.base = *cfg.Etcd
	}
	if env.cli, err = env.client(); err != nil {
		return nil, err
	}
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	st, err := env.cli.Status(sctx, env.base.Endpoints[0])
	if err != nil {
		return nil, fmt.Errorf("bench: etcd at %v: %w", env.base.Endpoints, err)
	}
	if !env.embedded {
		env.desc = fmt.Sprintf("etcd v%s at %s", st.Version, strings.Join(env.base.Endpoints, ","))
	}
	return env, nil
}

// client returns a new client with its own connection, closed by close
// unless the scenario closes it first (as a crash does).
func (env *benchEnv) client(opts ...grpc.DialOption) (*clientv3.Client, error) {
	return env.clientOf(env.base, opts...)
}

// clientOf is client for another etcd: base is its configuration.
func (env *benchEnv) clientOf(base clientv3.Config, opts ...grpc.DialOption) (*clientv3.Client, error) {
	cfg := base
	cfg.DialOptions = append(append([]grpc.DialOption(nil), cfg.DialOptions...), opts...)
	c, err := clientv3.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("bench: new etcd client: %w", err)
	}
	env.mu.Lock()
	env.clients = append(env.clients, c)
	env.mu.Unlock()
	return c, nil
}

// prefix returns a fresh key prefix under the run's root, ending in "/".
func (env *benchEnv) prefix(parts ...string) string {
	return env.root + strings.Join(parts, "/") + "/"
}

// progress reports on the run's Progress; the two sides of a scenario may report at
// once.
func (env *benchEnv) progress(format string, args ...any) {
	env.logMu.Lock()
	defer env.logMu.Unlock()
	fmt.Fprintf(env.log, "[%6.1fs] %s\n", time.Since(env.started).Seconds(), fmt.Sprintf(format, args...))
}

// settle tidies up between scenarios: on the embedded etcd it compacts the
// history (nothing watches it any more), and it collects garbage, so that
// a scenario does not pay for the previous one.
func (env *benchEnv) settle(ctx context.Context) {
	if env.embedded {
		if g, err := env.cli.Get(ctx, "/", clientv3.WithCountOnly()); err == nil {
			_, _ = env.cli.Compact(ctx, g.Header.Revision, clientv3.WithCompactPhysical())
		}
	}
	runtime.GC()
}

// close deletes what the run wrote, closes every client and stops the
// embedded etcd.
func (env *benchEnv) close() error {
	var err error
	if env.cli != nil && !env.embedded {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		if _, derr := env.cli.Delete(ctx, env.root, clientv3.WithPrefix()); derr != nil {
			err = fmt.Errorf("bench: deleting %s: %w", env.root, derr)
		}
		cancel()
	}
	env.mu.Lock()
	clients := env.clients
	env.clients = nil
	env.mu.Unlock()
	for _, c := range clients {
		_ = c.Close() // a crashed host's client is closed already
	}
	if env.srv != nil {
		env.srv.Close()
	}
	if env.dir != "" {
		if rerr := os.RemoveAll(env.dir); rerr != nil {
			err = errors.Join(err, fmt.Errorf("bench: %w", rerr))
		}
	}
	return err
}

// benchMeta returns realistic metadata for host i of a scenario's side.
func benchMeta(side string, i int) coord.HostMetadata {
	return coord.HostMetadata{
		HostUUID:   fmt.Sprintf("%08x-%04x-4000-8000-%012x", benchHashSide(side), i>>16, i),
		Hostname:   fmt.Sprintf("%s-node-%05d.dc1.example.net", side, i),
		Hypervisor: "kvm",
		Version:    "1.4.2",
		StartedAt:  1767225600_000000000 + int64(i),
		Labels:     map[string]string{"zone": fmt.Sprintf("z%d", i%3), "rack": fmt.Sprintf("r%02d", i%40)},
	}
}

func benchHashSide(s string) uint32 {
	h := uint32(2166136261)
	for i := 0; i < len(s); i++ {
		h = (h ^ uint32(s[i])) * 16777619
	}
	return h
}

func benchValue(m coord.HostMetadata) string {
	b, _ := json.Marshal(m)
	return string(b)
}

// benchPutHosts writes n hosts of side under prefix, attached to lease, in
// transactions of up to 100 puts (etcd's default limit is 128 operations),
// a few at a time: the way to register 100,000 hosts in seconds.
func benchPutHosts(ctx context.Context, cli *clientv3.Client, prefix, side string, n int, lease clientv3.LeaseID) error {
	const batch, writers = 100, 4
	var wg sync.WaitGroup
	errs := make([]error, writers)
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for lo := w * batch; lo < n && errs[w] == nil; lo += writers * batch {
				ops := make([]clientv3.Op, 0, batch)
				for i := lo; i < min(lo+batch, n); i++ {
					m := benchMeta(side, i)
					ops = append(ops, clientv3.OpPut(prefix+m.HostUUID, benchValue(m), clientv3.WithLease(lease)))
				}
				if _, err := cli.Txn(ctx).Then(ops...).Commit(); err != nil {
					errs[w] = fmt.Errorf("bench: writing hosts: %w", err)
				}
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// benchHostLog records, per host, when a watcher delivered its Up and Down
// events, and lets a scenario wait for them.
type benchHostLog struct {
	mu   sync.Mutex
	up   map[string]time.Time
	down map[string]time.Time
	kick chan struct{}
}

func newBenchHostLog() *benchHostLog {
	return &benchHostLog{up: map[string]time.Time{}, down: map[string]time.Time{}, kick: make(chan struct{}, 1)}
}

func (l *benchHostLog) add(kind coord.HostEventKind, id string, at time.Time) {
	l.mu.Lock()
	switch kind {
	case coord.HostUp:
		l.up[id] = at
	case coord.HostDown:
		if _, ok := l.down[id]; !ok {
			l.down[id] = at
		}
	}
	l.mu.Unlock()
	select {
	case l.kick <- struct{}{}:
	default:
	}
}

// wait waits until cond, called with l.mu held, holds; ctx or timeout end
// the wait with an error saying what was awaited.
func (l *benchHostLog) wait(ctx context.Context, timeout time.Duration, what string, cond func() bool) error {
	t := time.NewTimer(timeout)
	defer t.Stop()
	for {
		l.mu.Lock()
		ok := cond()
		l.mu.Unlock()
		if ok {
			return nil
		}
		select {
		case <-l.kick:
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
			return fmt.Errorf("bench: no %s after %v", what, timeout)
		}
	}
}

// waitUps waits for the Ups of n hosts.
func (l *benchHostLog) waitUps(ctx context.Context, n int) error {
	return l.wait(ctx, 30*time.Second, "Up of every host", func() bool { return len(l.up) == n })
}

// waitDown waits for id's Down, named what in the error if it does not
// come, and returns when it was seen.
func (l *benchHostLog) waitDown(ctx context.Context, id, what string) (time.Time, error) {
	if err := l.wait(ctx, 10*time.Second, what, func() bool { _, ok := l.down[id]; return ok }); err != nil {
		return time.Time{}, err
	}
	at, _ := l.downAt(id)
	return at, nil
}

// downAt returns when id was seen Down.
func (l *benchHostLog) downAt(id string) (time.Time, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	t, ok := l.down[id]
	return t, ok
}

// benchWatchCoord runs a coord.HostWatcher on prefix, calling on for each of
// its events, and returns once it has synced. stop closes it and waits.
func benchWatchCoord(ctx context.Context, cli *clientv3.Client, prefix string, on func(coord.HostEvent)) (stop func(), err error) {
	w, err := coord.NewHostWatcher(ctx, cli, coord.WatcherOptions{Prefix: prefix})
	if err != nil {
		return nil, err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ev := range w.Events() {
			on(ev)
		}
	}()
	stop = func() { w.Close(); <-done }
	select {
	case <-w.Synced():
		return stop, nil
	case <-done:
		stop()
		return nil, fmt.Errorf("bench: watcher ended before syncing: %v", w.Err())
	case <-ctx.Done():
		stop()
		return nil, ctx.Err()
	}
}

// benchPlainWatch is what a user writes without coord: Get the prefix, decode
// each host into a map, Watch from the next revision and keep the map up
// to date, calling on for each change once it is applied. It returns how
// many keys the Get listed; stop ends the watch.
func benchPlainWatch(ctx context.Context, cli *clientv3.Client, prefix string, on func(kind coord.HostEventKind, id string, rev int64, at time.Time)) (listed int, stop func(), err error) {
	resp, err := cli.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return 0, nil, err
	}
	hosts := make(map[string]coord.HostMetadata, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var m coord.HostMetadata
		if json.Unmarshal(kv.Value, &m) == nil {
			hosts[m.HostUUID] = m
		}
	}
	wctx, cancel := context.WithCancel(ctx)
	wch := cli.Watch(wctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
	done := make(chan struct{})
	go func() {
		defer close(done)
		for wr := range wch {
			for _, ev := range wr.Events {
				id := strings.TrimPrefix(string(ev.Kv.Key), prefix)
				kind := coord.HostDown
				if ev.Type == clientv3.EventTypePut {
					var m coord.HostMetadata
					if json.Unmarshal(ev.Kv.Value, &m) != nil {
						continue
					}
					kind = coord.HostUp
					if _, ok := hosts[id]; ok {
						kind = coord.HostUpdated
					}
					hosts[id] = m
				} else {
					delete(hosts, id)
				}
				on(kind, id, ev.Kv.ModRevision, time.Now())
			}
		}
	}()
	return len(resp.Kvs), func() { cancel(); <-done }, nil
}

// benchGrantedTTL asks etcd for a lease of ttl and returns the TTL it grants
// (etcd raises short TTLs to its minimum).
func benchGrantedTTL(ctx context.Context, cli *clientv3.Client, ttl time.Duration) (time.Duration, error) {
	g, err := cli.Grant(ctx, int64(ttl/time.Second))
	if err != nil {
		return 0, fmt.Errorf("bench: grant: %w", err)
	}
	_, _ = cli.Revoke(ctx, g.ID)
	return time.Duration(g.TTL) * time.Second, nil
}

// benchSleep sleeps for d or until ctx ends.
func benchSleep(ctx context.Context, d time.Duration) error {
	select {
	case <-time.After(d): // since Go 1.23 an unfired timer is garbage, not a leak
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// benchParallel calls do(i) for every i in [0, n), with up to workers
// calls at once, and returns the first error; after one, no more calls
// start.
func benchParallel(ctx context.Context, n, workers int, do func(i int) error) error {
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		next int
		err  error
	)
	for range min(workers, n) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				mu.Lock()
				i := next
				next++
				stop := err != nil || i >= n
				mu.Unlock()
				if stop {
					return
				}
				e := do(i)
				if e == nil {
					e = ctx.Err()
				}
				if e != nil {
					mu.Lock()
					if err == nil {
						err = e
					}
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	return err
}

// benchBoth runs the coord and the plain side of a scenario at once, for
// scenarios that mostly wait (on TTLs, or on a window).
func benchBoth[T any](run func(side string) (T, error)) (c, p T, err error) {
	var wg sync.WaitGroup
	var cerr, perr error
	wg.Add(2)
	go func() { defer wg.Done(); c, cerr = run("coord") }()
	go func() { defer wg.Done(); p, perr = run("plain") }()
	wg.Wait()
	if cerr != nil {
		cerr = fmt.Errorf("coord: %w", cerr)
	}
	if perr != nil {
		perr = fmt.Errorf("plain: %w", perr)
	}
	return c, p, errors.Join(cerr, perr)
}

// benchInTurn runs the coord side of a scenario, then the plain one,
// tidying up after each, for scenarios that measure this process's CPU
// time: the sides must not overlap, nor pay for each other's garbage.
func benchInTurn[T any](ctx context.Context, env *benchEnv, run func(side string) (T, error)) (c, p T, err error) {
	var res [2]T
	for i, side := range []string{"coord", "plain"} {
		if res[i], err = run(side); err != nil {
			return c, p, fmt.Errorf("%s: %w", side, err)
		}
		env.settle(ctx)
	}
	return res[0], res[1], nil
}

// benchPlainRegister registers host m at key as a user does without coord:
// a lease of ttl, renewed until renewCtx ends or the client closes, and the
// key on it. It returns the lease, also when a later step fails (so that
// the caller can revoke it; NoLease if the grant failed), and the TTL etcd
// granted.
func benchPlainRegister(ctx, renewCtx context.Context, cli *clientv3.Client, key string, m coord.HostMetadata, ttl time.Duration) (clientv3.LeaseID, time.Duration, error) {
	g, err := cli.Grant(ctx, int64(ttl/time.Second))
	if err != nil {
		return clientv3.NoLease, 0, err
	}
	ka, err := cli.KeepAlive(renewCtx, g.ID)
	if err != nil {
		return g.ID, 0, err
	}
	go func() {
		for range ka {
		}
	}()
	if _, err := cli.Put(ctx, key, benchValue(m), clientv3.WithLease(g.ID)); err != nil {
		return g.ID, 0, err
	}
	return g.ID, time.Duration(g.TTL) * time.Second, nil
}
