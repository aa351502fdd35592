package coord

// Histories of fenced registers, checked for linearizability by porcupine
// (the checker of etcd's robustness tests). A fenced register is a key
// written only by Txns under a Guard: the model tests record each such
// write, from just before its Txn to just after its answer, and the
// linearizable reads of a checker client of their own, and porcupine
// checks the history against a sequential register whose writes are
// fenced: reads return the last successful write's value, and a write
// succeeds only if its token is not older than that write's.

import (
	"context"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// fhTimeout bounds a porcupine check.
func fhTimeout() time.Duration { return 30 * time.Second * scale }

// fhReadEvery is how often a checker reads the registers: with the
// writers' pace (tens of milliseconds), it keeps a history to a few
// thousand operations per key and minute.
const fhReadEvery = 50 * time.Millisecond

// fhOutcome is how a fenced write ended, as its writer saw it.
type fhOutcome int

const (
	fhPending fhOutcome = iota // not answered yet: unknown once the history is checked
	fhOK                       // the Txn succeeded: the Guard held
	fhRefused                  // the Txn was answered, Succeeded false: the Guard did not hold
	fhUnknown                  // an error: it may or may not have been applied, even later
)

var fhOutcomeNames = []string{"pending", "ok", "refused", "unknown"}

func (o fhOutcome) String() string { return fhOutcomeNames[o] }

// fhInput is an operation on the fenced register key: a read, or a write
// of value by owner under token.
type fhInput struct {
	key   string
	read  bool
	owner string
	token int64
	value string
}

// fhOutput is what an operation returned: a write's outcome, or the value
// read ("" if there was no key).
type fhOutput struct {
	outcome fhOutcome
	value   string
}

// fhState is a register: the value of the last write that succeeded, with
// its token and owner (the zero fhState: never written).
type fhState struct {
	token int64
	owner string
	value string
}

// fhFollows reports whether a write of in may succeed after the one that
// left s. The writes' Txns compare only their Guard, which says nothing of
// other terms: the register adds that no write by an older token succeeds
// after one by a newer token did, nor one by another owner of the same
// token (tokens are create revisions, one term's each). That is the "no
// overlap" property the overlap counts check by other means.
func fhFollows(s fhState, in fhInput) bool {
	return in.token > s.token || in.token == s.token && in.owner == s.owner
}

// fhStep is the register's step. A write of unknown outcome is a
// nondeterministic step, as etcd's robustness tests model a failed
// request: applied (if it may be) or not.
func fhStep(state, input, output any) []any {
	s, in, out := state.(fhState), input.(fhInput), output.(fhOutput)
	written := fhState{token: in.token, owner: in.owner, value: in.value}
	switch {
	case in.read && out.value == s.value, !in.read && out.outcome == fhRefused:
		return []any{s}
	case in.read:
		return nil
	case !fhFollows(s, in) && out.outcome == fhOK:
		return nil
	case !fhFollows(s, in):
		return []any{s}
	case out.outcome == fhOK:
		return []any{written}
	}
	return []any{s, written}
}

// fhPartition splits a history by key: each key is a register of its own.
func fhPartition(ops []porcupine.Operation) [][]porcupine.Operation {
	by := map[string][]porcupine.Operation{}
	for _, op := range ops {
		k := op.Input.(fhInput).key
		by[k] = append(by[k], op)
	}
	var out [][]porcupine.Operation
	for _, k := range slices.Sorted(maps.Keys(by)) {
		out = append(out, by[k])
	}
	return out
}

func fhDescribe(input, output any) string {
	in, out := input.(fhInput), output.(fhOutput)
	if in.read {
		return fmt.Sprintf("read -> %q", out.value)
	}
	return fmt.Sprintf("write %q by %s, token %d: %v", in.value, in.owner, in.token, out.outcome)
}

// fhModel is the fenced register as a porcupine model, partitioned by key.
func fhModel() porcupine.Model {
	nm := &porcupine.NondeterministicModel{
		Partition:         fhPartition,
		Init:              func() []any { return []any{fhState{}} },
		Step:              fhStep,
		DescribeOperation: fhDescribe,
		DescribeState: func(state any) string {
			s := state.(fhState)
			return fmt.Sprintf("%q (token %d, %s)", s.value, s.token, s.owner)
		},
	}
	return nm.ToModel()
}

// fhComplete readies a history for the check: a write not answered is of
// unknown outcome, and a write of unknown outcome may have been applied up
// to the end of the history, so it returns at the end. A write of unknown
// outcome whose value no read returned is left out (the count is
// returned): the register may always take it as not applied, and leaving
// it out spares porcupine a branch that nothing constrains.
func fhComplete(ops []porcupine.Operation) (out []porcupine.Operation, unread int) {
	var end int64
	read := map[[2]string]bool{}
	for _, op := range ops {
		end = max(end, op.Return+1)
		if in := op.Input.(fhInput); in.read {
			read[[2]string{in.key, op.Output.(fhOutput).value}] = true
		}
	}
	for _, op := range ops {
		in, o := op.Input.(fhInput), op.Output.(fhOutput)
		if !in.read && (o.outcome == fhPending || o.outcome == fhUnknown) {
			if !read[[2]string{in.key, in.value}] {
				unread++
				continue
			}
			op.Output, op.Return = fhOutput{outcome: fhUnknown}, end
		}
		out = append(out, op)
	}
	return out, unread
}

// fhHistory records the operations on fenced registers. It is safe for
// concurrent use; a nil *fhHistory records nothing.
type fhHistory struct {
	start time.Time // times are nanoseconds since, on the monotonic clock

	mu      sync.Mutex
	ops     []porcupine.Operation
	clients int
}

func newFhHistory() *fhHistory { return &fhHistory{start: time.Now()} }

func (h *fhHistory) now() int64 { return time.Since(h.start).Nanoseconds() }

// client returns an id for a writer or a reader, whose operations follow
// one another (porcupine draws one line per client).
func (h *fhHistory) client() int {
	if h == nil {
		return 0
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.clients++
	return h.clients - 1
}

// write runs txn, a Txn under a Guard of owner's with token that puts
// value at key, records it, and returns its answer.
func (h *fhHistory) write(client int, key, owner string, token int64, value string,
	txn func() (*clientv3.TxnResponse, error)) (*clientv3.TxnResponse, error) {
	if h == nil {
		return txn()
	}
	h.mu.Lock()
	i := len(h.ops)
	h.ops = append(h.ops, porcupine.Operation{
		ClientId: client, Call: h.now(), Output: fhOutput{outcome: fhPending},
		Input: fhInput{key: key, owner: owner, token: token, value: value},
	})
	h.mu.Unlock()
	resp, err := txn()
	ret := h.now()
	out := fhUnknown
	switch {
	case err == nil && resp.Succeeded:
		out = fhOK
	case err == nil:
		out = fhRefused
	}
	h.mu.Lock()
	h.ops[i].Output, h.ops[i].Return = fhOutput{outcome: out}, ret
	h.mu.Unlock()
	return resp, err
}

// read reads keys, sorted, in one linearizable Get (of the range from the
// first to the last) and records a read of each. A Get that fails is not
// recorded: a read has no effect.
func (h *fhHistory) read(ctx context.Context, cli *clientv3.Client, client int, keys []string) error {
	call := h.now()
	resp, err := cli.Get(ctx, keys[0], clientv3.WithRange(keys[len(keys)-1]+"\x00"))
	ret := h.now()
	if err != nil {
		return err
	}
	got := map[string]string{}
	for _, kv := range resp.Kvs {
		got[string(kv.Key)] = string(kv.Value)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, k := range keys {
		h.ops = append(h.ops, porcupine.Operation{
			ClientId: client, Call: call, Return: ret,
			Input: fhInput{key: k, read: true}, Output: fhOutput{value: got[k]},
		})
	}
	return nil
}

// fhReader is a checker client that reads registers at intervals.
type fhReader struct {
	h      *fhHistory
	cli    *clientv3.Client
	keys   []string
	client int
	cancel context.CancelFunc
	done   chan struct{}
	once   sync.Once
}

// readEvery starts reading keys through cli every d, until finish or the
// end of the test. cli should be the checker's own, direct to etcd.
func (h *fhHistory) readEvery(t *testing.T, cli *clientv3.Client, d time.Duration, keys ...string) *fhReader {
	ctx, cancel := context.WithCancel(context.Background())
	r := &fhReader{h: h, cli: cli, keys: slices.Sorted(slices.Values(keys)), client: h.client(),
		cancel: cancel, done: make(chan struct{})}
	t.Cleanup(r.stop)
	go func() {
		defer close(r.done)
		tick := time.NewTicker(d)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			// A read that fails (etcd stopped) is not recorded; the next
			// tick tries again.
			rctx, rcancel := context.WithTimeout(ctx, time.Second*scale)
			r.h.read(rctx, r.cli, r.client, r.keys)
			rcancel()
		}
	}()
	return r
}

func (r *fhReader) stop() {
	r.once.Do(func() {
		r.cancel()
		<-r.done
	})
}

// finish stops the reads at intervals and reads once more, retrying: the
// final state, once every write has been answered. It returns an error if
// no read succeeded within patience.
func (r *fhReader) finish() error {
	r.stop()
	deadline := time.Now().Add(patience())
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second*scale)
		err := r.h.read(ctx, r.cli, r.client, r.keys)
		cancel()
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// fhCheck checks ops with porcupine against the fenced register, within
// fhTimeout.
func fhCheck(ops []porcupine.Operation) (porcupine.CheckResult, porcupine.LinearizationInfo) {
	return porcupine.CheckOperationsVerbose(fhModel(), ops, fhTimeout())
}

// check checks the history with porcupine and logs its sizes and the time
// the check took. A history that does not linearize, or one porcupine
// could not decide within fhTimeout, fails t; porcupine's visualization
// of it is written to a file, whose path is logged. seed is the run's, for
// the messages.
func (h *fhHistory) check(t *testing.T, seed uint64) {
	t.Helper()
	h.mu.Lock()
	ops, unread := fhComplete(h.ops)
	h.mu.Unlock()
	began := time.Now()
	res, info := fhCheck(ops)
	took := time.Since(began)
	t.Logf("porcupine: %s; %v in %v", fhSizes(ops, unread), res, took.Round(time.Millisecond))
	if res == porcupine.Ok {
		return
	}
	path, err := fhVisualize(t.Name(), info)
	if err != nil {
		t.Logf("porcupine: visualization not written: %v", err)
	} else {
		t.Logf("porcupine: visualization in %s", path)
	}
	if res == porcupine.Illegal {
		t.Errorf("seed %d: the fenced writes and reads of %s do not linearize as a fenced register",
			seed, strings.Join(fhIllegal(ops), ", "))
	} else {
		t.Errorf("seed %d: porcupine could not decide within %v whether the history linearizes", seed, fhTimeout())
	}
}

// fhIllegal returns the keys whose operations in ops do not linearize.
func fhIllegal(ops []porcupine.Operation) []string {
	var keys []string
	for _, p := range fhPartition(ops) {
		if porcupine.CheckOperationsTimeout(fhModel(), p, fhTimeout()) == porcupine.Illegal {
			keys = append(keys, p[0].Input.(fhInput).key)
		}
	}
	return keys
}

// fhSizes describes a history: operations by kind and outcome, and per
// key.
func fhSizes(ops []porcupine.Operation, unread int) string {
	outcomes := map[fhOutcome]int{}
	reads := 0
	perKey := map[string]int{}
	for _, op := range ops {
		in := op.Input.(fhInput)
		perKey[in.key]++
		if in.read {
			reads++
		} else {
			outcomes[op.Output.(fhOutput).outcome]++
		}
	}
	var keys []string
	for _, k := range slices.Sorted(maps.Keys(perKey)) {
		keys = append(keys, fmt.Sprintf("%s=%d", k, perKey[k]))
	}
	return fmt.Sprintf("%d operations, keys %d: writes %d ok, %d refused, %d unknown (and %d unknown never read, left out), %d reads; per key %s",
		len(ops), len(perKey), outcomes[fhOK], outcomes[fhRefused], outcomes[fhUnknown], unread, reads, strings.Join(keys, " "))
}

// fhVisualize writes porcupine's visualization of info into
// $COORD_TEST_ARTIFACTS, or the system's temporary directory, and returns
// the file's path. (t.TempDir is removed at the end of the test.)
func fhVisualize(test string, info porcupine.LinearizationInfo) (string, error) {
	dir := os.Getenv("COORD_TEST_ARTIFACTS")
	if dir == "" {
		dir = os.TempDir()
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	f, err := os.CreateTemp(dir, "porcupine-"+strings.NewReplacer("/", "_", " ", "_").Replace(test)+"-*.html")
	if err != nil {
		return "", err
	}
	if err := f.Close(); err != nil {
		return "", err
	}
	return f.Name(), porcupine.VisualizePath(fhModel(), info, f.Name())
}

// TestFencedRegisterCheck checks the checker on histories made by hand: it
// accepts what fenced writes may do, and rejects what they must not, so
// that the model tests' checks cannot pass vacuously.
func TestFencedRegisterCheck(t *testing.T) {
	w := func(owner string, token int64, value string, call, ret int64, out fhOutcome) porcupine.Operation {
		return porcupine.Operation{ClientId: int(token), Call: call, Return: ret,
			Input: fhInput{key: "k", owner: owner, token: token, value: value}, Output: fhOutput{outcome: out}}
	}
	r := func(value string, call, ret int64) porcupine.Operation {
		return porcupine.Operation{ClientId: 0, Call: call, Return: ret,
			Input: fhInput{key: "k", read: true}, Output: fhOutput{value: value}}
	}
	check := func(t *testing.T, ops ...porcupine.Operation) (porcupine.CheckResult, porcupine.LinearizationInfo) {
		t.Helper()
		ops, _ = fhComplete(ops)
		res, info := fhCheck(ops)
		if res == porcupine.Unknown {
			t.Fatalf("porcupine could not decide within %v", fhTimeout())
		}
		return res, info
	}
	legal := []struct {
		name string
		ops  []porcupine.Operation
	}{
		{"a handover, the old owner's writes refused, reads of each term", []porcupine.Operation{
			r("", 0, 5),
			w("a", 5, "a1", 10, 20, fhOK), r("a1", 21, 25), w("a", 5, "a2", 30, 40, fhOK),
			w("b", 9, "b1", 50, 60, fhOK), w("a", 5, "a3", 55, 70, fhRefused), r("b1", 71, 75)}},
		{"concurrent writes by an old and a new owner, linearized in token order", []porcupine.Operation{
			w("a", 5, "a1", 10, 50, fhOK), w("b", 9, "b1", 20, 40, fhOK), r("b1", 60, 70)}},
		{"writes of unknown outcome: one read later, one never answered, one never read", []porcupine.Operation{
			w("a", 5, "a1", 10, 20, fhOK), w("a", 5, "a2", 30, 0, fhUnknown), r("a1", 40, 45), r("a2", 50, 55),
			w("a", 5, "a3", 60, 0, fhPending), r("a2", 70, 75),
			w("a", 5, "a4", 80, 0, fhUnknown), r("a2", 90, 95)}},
		{"a new owner's write of unknown outcome not applied", []porcupine.Operation{
			w("a", 5, "a1", 10, 20, fhOK), w("b", 9, "b1", 30, 40, fhUnknown), r("a1", 50, 55), w("a", 5, "a2", 60, 70, fhOK),
			r("a2", 80, 85)}},
	}
	for _, c := range legal {
		t.Run("accepts "+c.name, func(t *testing.T) {
			if res, _ := check(t, c.ops...); res != porcupine.Ok {
				t.Fatalf("%v, want Ok", res)
			}
		})
	}
	illegal := []struct {
		name string
		ops  []porcupine.Operation
	}{
		{"a write by an older token after a newer one succeeded", []porcupine.Operation{
			w("b", 9, "b1", 10, 20, fhOK), w("a", 5, "a1", 30, 40, fhOK)}},
		{"a write by another owner of the same token", []porcupine.Operation{
			w("a", 5, "a1", 10, 20, fhOK), w("b", 5, "b1", 30, 40, fhOK)}},
		{"an older token's write of unknown outcome read after a newer one's", []porcupine.Operation{
			w("a", 5, "a1", 0, 0, fhUnknown), w("b", 9, "b1", 10, 20, fhOK), r("a1", 30, 40)}},
		{"a read of a value never written", []porcupine.Operation{
			w("a", 5, "a1", 10, 20, fhOK), r("x", 30, 40)}},
		{"a read of a value overwritten before it began", []porcupine.Operation{
			w("a", 5, "a1", 10, 20, fhOK), w("a", 5, "a2", 30, 40, fhOK), r("a1", 50, 60)}},
		{"a read of a refused write", []porcupine.Operation{
			w("a", 5, "a1", 10, 20, fhOK), w("a", 5, "a2", 30, 40, fhRefused), r("a2", 50, 60)}},
	}
	for _, c := range illegal {
		t.Run("rejects "+c.name, func(t *testing.T) {
			if res, _ := check(t, c.ops...); res != porcupine.Illegal {
				t.Fatalf("%v, want Illegal", res)
			}
		})
	}
	t.Run("partitions by key: each key is checked alone", func(t *testing.T) {
		other := w("b", 9, "b1", 10, 20, fhOK)
		other.Input = fhInput{key: "other", owner: "b", token: 9, value: "b1"}
		if res, _ := check(t, other, w("a", 5, "a1", 30, 40, fhOK), r("a1", 50, 60)); res != porcupine.Ok {
			t.Fatalf("%v, want Ok", res)
		}
	})
	t.Run("names the keys that do not linearize", func(t *testing.T) {
		ops := slices.Clone(illegal[0].ops)
		for _, op := range legal[0].ops {
			in := op.Input.(fhInput)
			in.key = "other"
			op.Input = in
			ops = append(ops, op)
		}
		if got := fhIllegal(ops); !slices.Equal(got, []string{"k"}) {
			t.Fatalf("%q, want [k]", got)
		}
	})
	t.Run("writes the visualization of a history that does not linearize", func(t *testing.T) {
		t.Setenv("COORD_TEST_ARTIFACTS", t.TempDir())
		_, info := check(t, illegal[0].ops...)
		path, err := fhVisualize(t.Name(), info)
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(path)
		if err != nil || !strings.Contains(string(b), `token 9`) {
			t.Fatalf("visualization %s: %d bytes, %v; want the history described", path, len(b), err)
		}
	})
}
