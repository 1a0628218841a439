/**
 * One expert holder as its own process, for reproduction/bench-experts.ts: a libp2p node on
 * loopback TCP serving /shoal/experts/2.0.0 from expert-parallel shards. Prints one JSON line
 * {"peerId", "addrs"} when ready; stops on SIGTERM or when stdin closes.
 *
 *   node reproduction/expert-holder-process.ts --dir DIR --model KEY --experts 1:0,1:5,2:3 [--threads 1]
 */
import { readFile } from 'node:fs/promises'
import { join } from 'node:path'
import { parseArgs } from 'node:util'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { tcp } from '@libp2p/tcp'
import { createLibp2p } from 'libp2p'
import { createExpertHolder, serveExperts } from '../daemon/experts/index.ts'
import type { ExpertShardLayout } from '../shards/index.ts'

const { values } = parseArgs({ options: { dir: { type: 'string' }, model: { type: 'string' }, experts: { type: 'string' }, threads: { type: 'string', default: '1' } } })
const dir = values.dir!
const layout = JSON.parse(await readFile(join(dir, 'layout.json'), 'utf8')) as ExpertShardLayout
const experts = (values.experts ?? '').split(',').filter(Boolean).map(p => { const [layer, expert] = p.split(':').map(Number); return { layer: layer!, expert: expert! } })
const holder = createExpertHolder({ dir, layout, model: values.model!, experts, threads: Number(values.threads) })
await holder.start()
const node = await createLibp2p({
  addresses: { listen: ['/ip4/127.0.0.1/tcp/0'] },
  transports: [tcp()],
  connectionEncrypters: [noise()],
  streamMuxers: [yamux()],
  connectionMonitor: { enabled: false },
})
const server = await serveExperts(holder, {
  handle: async (protocol, handler) => { await node.handle(protocol, handler) },
  unhandle: async (protocol) => { await node.unhandle(protocol) },
  openStream: async () => { throw new Error('a holder opens no streams') },
})
process.stdout.write(JSON.stringify({ peerId: node.peerId.toString(), addrs: node.getMultiaddrs().map(String) }) + '\n')
const stop = async (): Promise<void> => {
  await server.stop()
  await node.stop()
  await holder.stop()
  process.exit(0)
}
process.on('SIGTERM', () => { void stop() })
process.stdin.on('close', () => { void stop() })
process.stdin.resume()
