// A Node.js (libuv) TCP echo server and client: the event-loop program of tests/programs.
// libuv closes every descriptor with syscall(SYS_close, fd), not libc's close(), and the
// next connection accepted or connected takes the number again.
//
//   node node_echo.js server                     prints "port N", echoes every connection,
//                                                ends its side when the client ends its own
//   node node_echo.js cluster [rr|shared]        the same server in 2 workers of Node's
//                                                cluster module: rr, the primary accepts
//                                                each connection and passes it to a worker
//                                                (sendmsg SCM_RIGHTS); shared, every worker
//                                                accepts on the listening socket itself
//   node node_echo.js client PORT SEQ CONC SIZE  SEQ connections one after another, then CONC
//                                                at once; each writes SIZE bytes derived from
//                                                its index, ends its side, and checks the echo
//                                                byte for byte and the EOF after it.  Prints
//                                                "ok N" (all N verified) or "bad ..." lines;
//                                                exit 0 iff all verified.
'use strict';
const net = require('net');
const crypto = require('crypto');

function payload(i, size) {
  const out = Buffer.alloc(size);
  let off = 0;
  for (let ctr = 0; off < size; ctr++) {
    off += crypto.createHash('sha256').update(`${i}/${ctr}`).digest().copy(out, off);
  }
  return out;
}

function server(announce = true) {
  const s = net.createServer((c) => {
    c.on('error', () => {});
    c.on('data', (d) => c.write(d));
    c.on('end', () => c.end());
  });
  s.listen(0, '127.0.0.1', () => { if (announce) console.log(`port ${s.address().port}`); });
}

function cluster(policy) {
  const c = require('cluster');
  if (!c.isPrimary) return server(false);
  c.schedulingPolicy = policy === 'shared' ? c.SCHED_NONE : c.SCHED_RR;   // rr: Linux's default
  let told = false;
  c.on('listening', (_w, addr) => { if (!told) { told = true; console.log(`port ${addr.port}`); } });
  for (let i = 0; i < 2; i++) c.fork();
}

function one(port, i, size) {
  return new Promise((resolve) => {
    const want = payload(i, size);
    const parts = [];
    const c = net.connect(port, '127.0.0.1', () => { c.write(want); c.end(); });
    c.on('data', (d) => parts.push(d));
    c.on('end', () => {
      const got = Buffer.concat(parts);
      resolve(got.equals(want) ? null : `bad ${i}: ${got.length} of ${size} bytes, equal prefix ${
        got.subarray(0, want.length).equals(want.subarray(0, got.length))}`);
    });
    c.on('error', (e) => resolve(`bad ${i}: ${e.code || e.message} after ${Buffer.concat(parts).length} bytes`));
  });
}

async function client(port, seq, conc, size) {
  const bad = [];
  for (let i = 0; i < seq; i++) {
    const r = await one(port, i, size);
    if (r) bad.push(r);
  }
  const rs = await Promise.all(Array.from({ length: conc }, (_, k) => one(port, seq + k, size)));
  for (const r of rs) if (r) bad.push(r);
  for (const b of bad) console.log(b);
  if (!bad.length) console.log(`ok ${seq + conc}`);
  process.exit(bad.length ? 1 : 0);
}

const [mode, ...args] = process.argv.slice(2);
if (mode === 'server') server();
else if (mode === 'cluster') cluster(args[0]);
else client(+args[0], +args[1], +args[2], +args[3]);
