package coord

import (
	"encoding/json"
	"errors"
	"math"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// Fuzz targets for what coord reads from etcd and from its callers. Seed
// corpora live in testdata/fuzz/<FuzzName>/; `go test` runs them, and
// `go test -fuzz=FuzzName` explores from them (see FAULTS.md).

// FuzzDecodeHost: whatever a key and its value hold, decodeHost does not
// panic, and what it accepts names the host its key names, and survives a
// round trip through JSON.
func FuzzDecodeHost(f *testing.F) {
	for _, s := range []struct{ prefix, key, value string }{
		{HostsPrefix, HostsPrefix + "a", `{"host_uuid":"a"}`},
		{HostsPrefix, HostsPrefix + "a", `{"host_uuid":"a","hostname":"h","hypervisor":"kvm","version":"1.0","started_at_unix_ns":1700000000000000000,"labels":{"zone":"a"}}`},
		{HostsPrefix, HostsPrefix + "a", `{"host_uuid":"b"}`},
		{HostsPrefix, HostsPrefix + "a", `{"HOST_UUID":"a"}`},
		{HostsPrefix, HostsPrefix + "a", `{"host_uuid":"b","host_uuid":"a"}`},
		{HostsPrefix, HostsPrefix + "a", `{"host_uuid":"a","labels":{}}`},
		{HostsPrefix, HostsPrefix + "a", `{"host_uuid":"a","labels":null,"extra":[1,2]}`},
		{HostsPrefix, HostsPrefix + "a", `{"host_uuid":"a","started_at_unix_ns":1e3}`},
		{HostsPrefix, HostsPrefix + "a", `{"host_uuid":"a","started_at_unix_ns":99999999999999999999}`},
		{HostsPrefix, HostsPrefix + "a", `{"host_uuid":"a"} trailing`},
		{HostsPrefix, HostsPrefix + "a", `null`},
		{HostsPrefix, HostsPrefix + "a", `[]`},
		{HostsPrefix, HostsPrefix + "a", ``},
		{HostsPrefix, HostsPrefix + "a", `garbage`},
		{HostsPrefix, HostsPrefix, `{"host_uuid":""}`},
		{HostsPrefix, HostsPrefix + "a/b", `{"host_uuid":"a/b"}`},
		{HostsPrefix, HostsPrefix + "é", `{"host_uuid":"\u00e9"}`},
		{HostsPrefix, HostsPrefix + "\xff", `{"host_uuid":"\xff"}`},
		{HostsPrefix, HostsPrefix + "\ufffd", `{"host_uuid":"\xff"}`},
		{HostsPrefix, HostsPrefix + "a\u2028b", `{"host_uuid":"a\u2028b"}`},
		{HostsPrefix, HostsPrefix + "\x00", `{"host_uuid":"\u0000"}`},
		{HostsPrefix, HostsPrefix + "a", `{"host_uuid":"a","hostname":"\xff\xfe"}`},
		{"/p/", "/q/a", `{"host_uuid":"/q/a"}`},
		{"/p/", "a", `{"host_uuid":"a"}`},
		{"", "a", `{"host_uuid":"a"}`},
	} {
		f.Add(s.prefix, []byte(s.key), []byte(s.value))
	}
	f.Fuzz(func(t *testing.T, prefix string, key, value []byte) {
		m, err := decodeHost(prefix, key, value)
		if err != nil {
			if !strings.HasPrefix(err.Error(), "coord: ") {
				t.Fatalf("error %q lacks the package prefix", err)
			}
			return
		}
		id := m.HostUUID
		if id == "" || strings.Contains(id, "/") || !utf8.ValidString(id) {
			t.Fatalf("accepted HostUUID %q breaks the rules", id)
		}
		if !strings.HasSuffix(string(key), id) || strings.HasPrefix(string(key), prefix) && string(key) != prefix+id {
			t.Fatalf("accepted %q at key %q under %q: not the key's suffix", id, key, prefix)
		}
		b, err := json.Marshal(m)
		if err != nil {
			t.Fatalf("accepted %+v cannot be encoded: %v", m, err)
		}
		again, err := decodeHost(prefix, key, b)
		if err != nil {
			t.Fatalf("accepted %+v, refused once encoded as %s: %v", m, b, err)
		}
		if b2, _ := json.Marshal(again); string(b2) != string(b) {
			t.Fatalf("round trip changed %s into %s", b, b2)
		}
	})
}

// FuzzValidateNames: the checks of names and durations do not panic, refuse
// with the documented sentinel errors, and accept only what the documented
// rules allow. An accepted HostUUID also survives the wire: written as
// HostMetadata JSON at <prefix><HostUUID>, it is read back as itself.
func FuzzValidateNames(f *testing.F) {
	for _, s := range []struct {
		name string
		ttl  int64
	}{
		{"a", 0},
		{"host-1", int64(time.Second)},
		{"", -1},
		{"/", int64(1500 * time.Millisecond)},
		{"a/b", int64(500 * time.Millisecond)},
		{"/coord/hosts/", int64(10 * time.Second)},
		{"/coord/election", int64(time.Nanosecond)},
		{"a//b", -int64(time.Second)},
		{"//", math.MaxInt64},
		{"a/", math.MinInt64},
		{"\xff", int64(9_100_000_000 * time.Second)},
		{"\x00", 1},
		{"é", int64(2 * time.Second)},
	} {
		f.Add(s.name, s.ttl)
	}
	f.Fuzz(func(t *testing.T, name string, n int64) {
		prefixed := func(err error) {
			t.Helper()
			if err != nil && !strings.HasPrefix(err.Error(), "coord: ") {
				t.Fatalf("error %q lacks the package prefix", err)
			}
		}

		err := checkHostUUID(name)
		prefixed(err)
		switch {
		case err != nil && !errors.Is(err, ErrInvalidHostUUID):
			t.Fatalf("checkHostUUID(%q): %v, want ErrInvalidHostUUID", name, err)
		case err == nil && (name == "" || strings.Contains(name, "/")):
			t.Fatalf("checkHostUUID(%q) accepted an empty HostUUID or one with a slash", name)
		case err != nil && name != "" && !strings.Contains(name, "/") && utf8.ValidString(name):
			t.Fatalf("checkHostUUID(%q) refused a valid HostUUID: %v", name, err)
		case err == nil:
			val, _ := json.Marshal(HostMetadata{HostUUID: name})
			m, err := decodeHost(HostsPrefix, []byte(HostsPrefix+name), val)
			if err != nil || m.HostUUID != name {
				t.Fatalf("accepted HostUUID %q comes back from the wire as %q, %v", name, m.HostUUID, err)
			}
		}

		err = checkElectionKey(name)
		prefixed(err)
		valid := name != "" && !strings.HasSuffix(name, "/") && !strings.Contains(name, "//")
		switch {
		case err != nil && !errors.Is(err, ErrInvalidKey):
			t.Fatalf("checkElectionKey(%q): %v, want ErrInvalidKey", name, err)
		case (err == nil) != valid:
			t.Fatalf("checkElectionKey(%q) = %v, want valid = %v", name, err, valid)
		}

		p, err := prefixOrDefault(name)
		prefixed(err)
		switch {
		case err != nil && !errors.Is(err, ErrInvalidKey):
			t.Fatalf("prefixOrDefault(%q): %v, want ErrInvalidKey", name, err)
		case name == "" && (err != nil || p != HostsPrefix):
			t.Fatalf("prefixOrDefault(\"\") = %q, %v; want HostsPrefix", p, err)
		case name != "" && (err == nil) != strings.HasSuffix(name, "/"):
			t.Fatalf("prefixOrDefault(%q) = %q, %v; want accepted exactly when it ends in /", name, p, err)
		case name != "" && err == nil && p != name:
			t.Fatalf("prefixOrDefault(%q) = %q", name, p)
		}

		d := time.Duration(n)
		got, err := ttlOrDefault(d, DefaultLivenessTTL)
		prefixed(err)
		switch {
		case err != nil && !errors.Is(err, ErrInvalidTTL):
			t.Fatalf("ttlOrDefault(%v): %v, want ErrInvalidTTL", d, err)
		case d == 0 && (err != nil || got != DefaultLivenessTTL):
			t.Fatalf("ttlOrDefault(0) = %v, %v; want the default", got, err)
		case d != 0 && (err == nil) != (d > 0 && d%time.Second == 0):
			t.Fatalf("ttlOrDefault(%v) = %v, %v; want accepted exactly when a positive whole number of seconds", d, got, err)
		case d != 0 && err == nil && (got != d || got/time.Second < 1):
			t.Fatalf("ttlOrDefault(%v) = %v", d, got)
		}
	})
}
