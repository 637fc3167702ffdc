#!/usr/bin/env node
// A scripted MCP peer for the MCP bridge tests (tests/envs/mcp_test.cpp): a small stdio server
// that behaves well or badly on purpose. Plain Node.js, no packages.
//
//   node peer.js MODE [PROTOCOL_VERSION]
//
// Modes:
//   normal      answers initialize with PROTOCOL_VERSION (default 2024-11-05, an older one),
//               lists its tools over two tools/list pages, sends a log notification and asks
//               the client roots/list and ping before the first page, and serves the tools below.
//   garbage     answers initialize, then writes a line that is not JSON instead of tools/list.
//   silent      reads requests and never answers.
//   exit-early  writes a line to stderr and exits with code 3 before answering anything.
//   stubborn    like normal, but ignores the end of stdin and SIGTERM (only SIGKILL ends it).
//   bad-version answers initialize with protocol version 1999-01-01.
//
// Tools (normal, stubborn): echo {text}, pid {}, image {}, resource {}, sleep {ms} (ms < 0:
// never answers), fail {} (isError), rpc_error {} (a JSON-RPC error answer), garbage {} (a
// non-JSON line), exit {code} (exits without answering), client_replies {} (the client's
// answers to our roots/list and ping requests, as JSON).
'use strict';
const readline = require('readline');

const mode = process.argv[2] || 'normal';
const version = process.argv[3] || '2024-11-05';
const send = (message) => process.stdout.write(JSON.stringify(message) + '\n');
const replies = {};

// A 1x1 PNG (one opaque red pixel).
const PNG_1x1 =
  'iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg==';

const object = (properties, required = []) => ({ type: 'object', properties, required });
const PAGE_1 = [
  { name: 'echo', description: 'Returns its text', inputSchema: object({ text: { type: 'string' } }, ['text']) },
  { name: 'pid', description: 'The server process id', inputSchema: object({}) },
  { name: 'image', title: 'An image', inputSchema: object({}) },
];
const PAGE_2 = [
  { name: 'resource', description: 'Embedded resources', inputSchema: object({}) },
  { name: 'sleep', description: 'Answers after ms', inputSchema: object({ ms: { type: 'integer' } }, ['ms']) },
  { name: 'fail', description: 'Always fails', inputSchema: object({}) },
  { name: 'rpc_error', description: 'Answers with a JSON-RPC error', inputSchema: object({}) },
  { name: 'garbage', description: 'Writes a line that is not JSON', inputSchema: object({}) },
  { name: 'exit', description: 'Exits', inputSchema: object({ code: { type: 'integer' } }, ['code']) },
  { name: 'client_replies', description: 'What the client answered us', inputSchema: object({}) },
];

const text = (t) => ({ content: [{ type: 'text', text: t }] });

function callTool(id, name, args) {
  switch (name) {
    case 'echo': return send({ jsonrpc: '2.0', id, result: text(String(args.text)) });
    case 'pid': return send({ jsonrpc: '2.0', id, result: text(String(process.pid)) });
    case 'image':
      return send({ jsonrpc: '2.0', id, result: { content: [
        { type: 'text', text: 'a red pixel' },
        { type: 'image', data: PNG_1x1, mimeType: 'image/png' },
        { type: 'image', data: Buffer.from('not really a jpeg').toString('base64'), mimeType: 'image/jpeg' },
      ] } });
    case 'resource':
      return send({ jsonrpc: '2.0', id, result: { content: [
        { type: 'resource', resource: { uri: 'file:///notes.txt', mimeType: 'text/plain', text: 'resource text' } },
        { type: 'resource', resource: { uri: 'file:///blob.bin', mimeType: 'application/octet-stream', blob: 'AAECAw==' } },
        { type: 'resource_link', uri: 'file:///linked.txt', name: 'linked' },
      ] } });
    case 'sleep':
      if (args.ms >= 0) setTimeout(() => send({ jsonrpc: '2.0', id, result: text(`slept ${args.ms} ms`) }), args.ms);
      return;
    case 'fail': return send({ jsonrpc: '2.0', id, result: { content: [{ type: 'text', text: 'it failed' }], isError: true } });
    case 'rpc_error': return send({ jsonrpc: '2.0', id, error: { code: -32602, message: 'no such thing' } });
    case 'garbage': return process.stdout.write('this is not JSON {\n');
    case 'exit': return process.exit(args.code);
    case 'client_replies': return send({ jsonrpc: '2.0', id, result: text(JSON.stringify(replies)) });
    default: return send({ jsonrpc: '2.0', id, error: { code: -32602, message: `Tool ${name} not found` } });
  }
}

function handle(message) {
  if (message.method === undefined) {  // an answer to one of our requests
    replies[message.id] = message.error !== undefined ? { error: message.error } : { result: message.result };
    return;
  }
  if (message.id === undefined) return;  // a notification
  const { id, method, params = {} } = message;
  if (mode === 'silent') return;
  if (method === 'initialize') {
    return send({ jsonrpc: '2.0', id, result: {
      protocolVersion: mode === 'bad-version' ? '1999-01-01' : version,
      capabilities: { tools: {}, logging: {} },
      serverInfo: { name: 'peer', version: '1.2.3' },
      instructions: 'a scripted peer',
    } });
  }
  if (mode === 'garbage') return process.stdout.write('<html>garbage</html>\n');
  if (method === 'tools/list') {
    if (!params.cursor) {
      send({ jsonrpc: '2.0', method: 'notifications/message', params: { level: 'info', data: 'listing tools' } });
      send({ jsonrpc: '2.0', id: 'roots-1', method: 'roots/list' });
      send({ jsonrpc: '2.0', id: 'ping-1', method: 'ping' });
      return send({ jsonrpc: '2.0', id, result: { tools: PAGE_1, nextCursor: 'page-2' } });
    }
    if (params.cursor === 'page-2') return send({ jsonrpc: '2.0', id, result: { tools: PAGE_2 } });
    return send({ jsonrpc: '2.0', id, error: { code: -32602, message: `bad cursor ${params.cursor}` } });
  }
  if (method === 'tools/call') return callTool(id, params.name, params.arguments || {});
  return send({ jsonrpc: '2.0', id, error: { code: -32601, message: `Method not found: ${method}` } });
}

if (mode === 'exit-early') {
  process.stderr.write('peer: giving up before the handshake\n');
  process.exit(3);
}
if (mode === 'stubborn') {
  process.on('SIGTERM', () => process.stderr.write('peer: ignoring SIGTERM\n'));
  setInterval(() => {}, 1000);  // stays alive after stdin ends
}
process.stderr.write(`peer: started in mode ${mode}\n`);
const lines = readline.createInterface({ input: process.stdin });
lines.on('line', (line) => {
  if (line.trim() === '') return;
  handle(JSON.parse(line));
});
