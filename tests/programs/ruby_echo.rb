# A Ruby TCP echo server (a thread per connection) and client (threads), bytes checked.
#   ruby ruby_echo.rb server                    prints "port N"
#   ruby ruby_echo.rb client PORT SEQ CONC SIZE prints "ok N" or "bad ..." lines
require 'socket'
require 'digest'

def payload(i, size)
  out = String.new(capacity: size + 32, encoding: Encoding::BINARY)
  ctr = 0
  while out.bytesize < size
    out << Digest::SHA256.digest("#{i}/#{ctr}")
    ctr += 1
  end
  out.byteslice(0, size)
end

def server
  s = TCPServer.new('127.0.0.1', 0)
  puts "port #{s.addr[1]}"
  $stdout.flush
  loop do
    c = s.accept
    Thread.new(c) do |conn|
      begin
        loop { conn.write(conn.readpartial(65536)) }
      rescue EOFError
        conn.close_write
      rescue => e
        $stderr.puts "server: #{e.class}: #{e.message}"
      ensure
        conn.close
      end
    end
  end
end

def one(port, i, size)
  want = payload(i, size)
  c = TCPSocket.new('127.0.0.1', port)
  w = Thread.new { c.write(want); c.close_write }
  got = String.new(encoding: Encoding::BINARY)
  begin
    loop { got << c.readpartial(65536) }
  rescue EOFError
  end
  w.join
  c.close
  got == want ? nil : "bad #{i}: #{got.bytesize} of #{size} bytes"
rescue => e
  "bad #{i}: #{e.class}: #{e.message}"
end

def client(port, seq, conc, size)
  bad = []
  seq.times { |i| r = one(port, i, size); bad << r if r }
  ths = (0...conc).map { |k| Thread.new { one(port, seq + k, size) } }
  ths.each { |t| r = t.value; bad << r if r }
  bad.each { |b| puts b }
  puts "ok #{seq + conc}" if bad.empty?
  exit(bad.empty? ? 0 : 1)
end

if ARGV[0] == 'server'
  server
else
  client(ARGV[1].to_i, ARGV[2].to_i, ARGV[3].to_i, ARGV[4].to_i)
end
