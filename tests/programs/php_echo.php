<?php
// A PHP echo server (one process, stream_select over every connection) and client.
//   php php_echo.php server                    prints "port N"
//   php php_echo.php client PORT SEQ CONC SIZE prints "ok N" or "bad ..." lines
function payload($i, $size) {
  $out = '';
  for ($ctr = 0; strlen($out) < $size; $ctr++) $out .= hash('sha256', "$i/$ctr", true);
  return substr($out, 0, $size);
}
function server() {
  $s = stream_socket_server('tcp://127.0.0.1:0', $errno, $errstr);
  if (!$s) { fwrite(STDERR, "$errstr\n"); exit(1); }
  $name = stream_socket_get_name($s, false);
  echo "port " . substr($name, strrpos($name, ':') + 1) . "\n";
  fflush(STDOUT);
  $conns = []; $out = [];
  while (true) {
    $r = array_merge([$s], array_values($conns));
    $w = [];
    foreach ($conns as $k => $c) if (strlen($out[$k])) $w[] = $c;
    $e = null;
    if (stream_select($r, $w, $e, 10) === false) break;
    foreach ($r as $c) {
      if ($c === $s) {
        $n = stream_socket_accept($s, 5);
        if ($n) { stream_set_blocking($n, false); $k = (int)$n; $conns[$k] = $n; $out[$k] = ''; }
        continue;
      }
      $k = (int)$c;
      $d = fread($c, 65536);
      if ($d === '' || $d === false) {
        if (feof($c)) {
          stream_set_blocking($c, true);
          if (strlen($out[$k])) fwrite($c, $out[$k]);
          stream_socket_shutdown($c, STREAM_SHUT_WR);
          fclose($c); unset($conns[$k]); unset($out[$k]);
        }
        continue;
      }
      $out[$k] .= $d;
    }
    foreach ($w as $c) {
      $k = (int)$c;
      if (!isset($conns[$k])) continue;
      $n = fwrite($c, $out[$k]);
      if ($n) $out[$k] = substr($out[$k], $n);
    }
  }
}
function one($port, $i, $size) {
  $want = payload($i, $size);
  $c = stream_socket_client("tcp://127.0.0.1:$port", $errno, $errstr, 10);
  if (!$c) return "bad $i: connect: $errstr";
  stream_set_blocking($c, false);
  $got = ''; $off = 0; $shut = false;
  $deadline = microtime(true) + 60;
  while (microtime(true) < $deadline) {
    $r = [$c]; $w = $off < $size ? [$c] : []; $e = null;
    if (stream_select($r, $w, $e, 5) === false) return "bad $i: select";
    if ($w) { $n = fwrite($c, substr($want, $off, 65536)); if ($n) $off += $n; }
    if ($off >= $size && !$shut) { stream_socket_shutdown($c, STREAM_SHUT_WR); $shut = true; }
    if ($r) {
      $d = fread($c, 65536);
      if ($d === '' && feof($c)) break;
      if ($d !== false) $got .= $d;
    }
  }
  fclose($c);
  return $got === $want ? null : "bad $i: " . strlen($got) . " of $size bytes";
}
if ($argv[1] === 'server') { server(); exit(0); }
[$port, $seq, $conc, $size] = array_map('intval', array_slice($argv, 2, 4));
$bad = [];
for ($i = 0; $i < $seq; $i++) { $r = one($port, $i, $size); if ($r) $bad[] = $r; }
$kids = [];
for ($k = 0; $k < $conc; $k++) {
  $pid = pcntl_fork();
  if ($pid === 0) { $r = one($port, $seq + $k, $size); if ($r) echo "$r\n"; exit($r ? 1 : 0); }
  $kids[] = $pid;
}
foreach ($kids as $pid) { pcntl_waitpid($pid, $st); if (pcntl_wexitstatus($st) != 0) $bad[] = "bad child $pid"; }
foreach ($bad as $b) echo "$b\n";
if (!$bad) echo "ok " . ($seq + $conc) . "\n";
exit($bad ? 1 : 0);
