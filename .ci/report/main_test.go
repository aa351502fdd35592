package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func write(t *testing.T, name, text string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func run(t *testing.T, f func(w writer) error) string {
	t.Helper()
	var b bytes.Buffer
	w := newWriter(&b)
	if err := f(w); err != nil {
		t.Fatal(err)
	}
	w.Flush()
	return b.String()
}

// The JSON strings are decoded whole: any \u escape, surrogate pairs.
func TestTextDecodes(t *testing.T) {
	log := write(t, "log.json", `{"Action":"run","Package":"p","Test":"T\u00e9"}
{"Action":"output","Package":"p","Test":"T\u00e9","Output":"=== RUN   T\u00e9\n"}
{"Action":"output","Package":"p","Test":"T\u00e9","Output":"    x_test.go:1: \u003c\u0026\u003e caf\u00e9 \ud83d\ude00\n"}
{"Action":"fail","Package":"p","Test":"T\u00e9"}
not JSON
{"Action":"output","Package":"p","Output":"PASS\n"}
{"Action":"output","Package":"p","Output":"FAIL\tp\t0.1s\n"}
`)
	got := run(t, func(w writer) error { return textCmd(w, log) })
	want := "    x_test.go:1: <&> café 😀\nFAIL\tp\t0.1s\n"
	if got != want {
		t.Errorf("text:\n%q\nwant\n%q", got, want)
	}
}

// A long failing output shows its first 40 lines, the number left out, and
// its last 41 (as the awk it replaced did).
func TestTextLong(t *testing.T) {
	var b strings.Builder
	for i := 1; i <= 100; i++ {
		fmt.Fprintf(&b, `{"Action":"output","Package":"p","Test":"T","Output":"%d\n"}`+"\n", i)
	}
	b.WriteString(`{"Action":"fail","Package":"p","Test":"T"}` + "\n")
	got := strings.Split(run(t, func(w writer) error { return textCmd(w, write(t, "log.json", b.String())) }), "\n")
	if len(got) != 83 || got[39] != "40" || got[40] != "    [... 20 lines omitted ...]" || got[41] != "60" || got[81] != "100" {
		t.Errorf("text: %q", got)
	}
}

func TestSkipsAndRow(t *testing.T) {
	log := write(t, "log.json", `{"Action":"run","Package":"p","Test":"TestA"}
{"Action":"output","Package":"p","Test":"TestA","Output":"    a_test.go:3: needs \u00e9tcd\n"}
{"Action":"output","Package":"p","Test":"TestA","Output":"--- SKIP: TestA (0.00s)\n"}
{"Action":"skip","Package":"p","Test":"TestA"}
{"Action":"run","Package":"p","Test":"TestB"}
{"Action":"skip","Package":"p","Test":"TestB"}
{"Action":"run","Package":"p","Test":"TestC"}
{"Action":"pass","Package":"p","Test":"TestC"}
{"Action":"run","Package":"p","Test":"TestD"}
`)
	skips := write(t, "skips", "# comment\n\nTestA a reason\n")
	got := run(t, func(w writer) error { return skipsCmd(w, log, skips) })
	if want := "declared\tTestA\tp\ta_test.go:3: needs étcd\nundeclared\tTestB\tp\t\n"; got != want {
		t.Errorf("skips: %q, want %q", got, want)
	}
	got = run(t, func(w writer) error { return rowCmd(w, "x", log, "", "3", "0", skips) })
	if want := "x\t1\t1\t2\t-\t3\tSKIP\n"; got != want {
		t.Errorf("row: %q, want %q", got, want)
	}
}

func TestCoverage(t *testing.T) {
	const m = "github.com/go-coord/coord/"
	profile := write(t, "cover.out", "mode: set\n"+
		m+"a.go:1.1,2.2 2 0\n"+
		m+"a.go:3.1,4.2 1 0\n"+
		m+"a.go:1.1,2.2 2 1\n"+ // the same block, run by another test binary
		m+"coordtest/b.go:1.1,2.2 5 0\n"+
		m+"a.go:5.1,6.2 1996 1\n")
	c, err := readCoverage(profile)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := c.stats(), "99.9 1998 1999"; got != want {
		t.Errorf("stats: %q, want %q", got, want)
	}
	got := run(t, func(w writer) error { c.missed(w, "  ", 100); return nil })
	if want := "  " + m + "a.go:3.1,4.2: 1 statement\n"; got != want {
		t.Errorf("missed: %q, want %q", got, want)
	}
	for _, g := range []struct {
		gate string
		ok   bool
	}{{"", false}, {"100.0", false}, {"99.9", true}, {"99.95", false}} {
		t.Setenv("COVERAGE_GATE", g.gate)
		if gateOK(1998, 1999) != g.ok {
			t.Errorf("gate %q: %v", g.gate, !g.ok)
		}
	}
}

// The compatibility table: a row per promise, a row per figure under it;
// a failed promise, or one missing from a run, fails.
func TestPromiseName(t *testing.T) {
	for test, want := range map[string]string{
		"TestCompat/liveness":                     "liveness",
		"TestCompatLeaderChange":                  "leader-change",
		"TestCompatLeaderChange/checkpoint=false": "leader-change/checkpoint=false",
		"TestCompatGRPCProxy/lease":               "grpc-proxy/lease",
		"TestCompatLeaderKill/CamelCase_sub":      "leader-kill/CamelCase_sub",
		"TestCompatX":                             "x",
		"TestOther":                               "",
	} {
		if got := promiseName(test); got != want {
			t.Errorf("promiseName(%q) = %q, want %q", test, got, want)
		}
	}
}

func TestCompat(t *testing.T) {
	a := write(t, "a.json", `{"Action":"run","Package":"p","Test":"TestCompat"}
{"Action":"run","Package":"p","Test":"TestCompat/liveness"}
{"Action":"output","Package":"p","Test":"TestCompat/liveness","Output":"    compat_test.go:1: compat: liveness ttl=2.000s crash→down=2.4s\n"}
{"Action":"pass","Package":"p","Test":"TestCompat/liveness"}
{"Action":"pass","Package":"p","Test":"TestCompat"}
{"Action":"run","Package":"p","Test":"TestCompatLeaderChange/checkpoint=false"}
{"Action":"output","Package":"p","Test":"TestCompatLeaderChange/checkpoint=false","Output":"    c.go:2: needs 3.5\n"}
{"Action":"skip","Package":"p","Test":"TestCompatLeaderChange/checkpoint=false"}
{"Action":"pass","Package":"p","Test":"TestCompatLeaderChange"}
`)
	b := write(t, "b.json", `{"Action":"run","Package":"p","Test":"TestCompat/liveness"}
{"Action":"output","Package":"p","Test":"TestCompat/liveness","Output":"    compat_test.go:1: compat: liveness ttl=2.000s\n"}
{"Action":"fail","Package":"p","Test":"TestCompat/liveness"}
`)
	var ok bool
	got := run(t, func(w writer) (err error) { ok, err = compatCmd(w, []string{"v1", a, "v2", b}); return err })
	want := `PROMISE / FIGURE                v1              v2            
liveness                        pass            FAIL          
  ttl                           2.000s          2.000s        
  crash→down                    2.4s            -             
leader-change/checkpoint=false  skip            MISSING       
leader-change/checkpoint=false on v1 skipped: c.go:2: needs 3.5
`
	if got != want || ok {
		t.Errorf("compat (ok %v):\n%s\nwant\n%s", ok, got, want)
	}
}

// A failing test whose message is followed by a long dump from one call
// site (a log dumped in a cleanup) shows that message again after the
// dump, before its result line; one without a dump shows nothing again.
func TestTextRecap(t *testing.T) {
	log := func(dump int) string {
		var b strings.Builder
		line := func(s string) {
			fmt.Fprintf(&b, `{"Action":"output","Package":"p","Test":"T","Output":%q}`+"\n", s)
		}
		line("    x_test.go:10: first failure\n")
		line("        its second line\n")
		for i := range dump {
			line(fmt.Sprintf("    helpers_test.go:387: record %d\n", i))
		}
		line("    x_test.go:12: a later error\n")
		line("--- FAIL: T (1.00s)\n")
		b.WriteString(`{"Action":"fail","Package":"p","Test":"T"}` + "\n")
		return write(t, "log.json", b.String())
	}
	got := run(t, func(w writer) error { return textCmd(w, log(20)) })
	want := "    helpers_test.go:387: record 19\n    x_test.go:12: a later error\n" +
		"    [again, the first lines not from a dump:]\n    x_test.go:10: first failure\n    x_test.go:12: a later error\n--- FAIL: T (1.00s)\n"
	if !strings.HasPrefix(got, "    x_test.go:10: first failure\n        its second line\n    helpers_test.go:387: record 0\n") || !strings.HasSuffix(got, want) {
		t.Errorf("text with a dump:\n%s", got)
	}
	if got := run(t, func(w writer) error { return textCmd(w, log(10)) }); strings.Contains(got, "again") || !strings.HasSuffix(got, "a later error\n--- FAIL: T (1.00s)\n") {
		t.Errorf("text without a dump:\n%s", got)
	}
}
