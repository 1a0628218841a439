/**
 * `shoal demo`: a local mesh of N daemons on loopback, a throwaway CA, the built-in demo model on
 * each. Every node has an API (any node serves any request); the first one's URL is the one to use.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { configFrom, startFailure } from '../daemon-config.ts'
import { ExitError } from '../exit-error.ts'
import { cacheRoot } from '../paths.ts'
import { cliLogger, runUntilSignal } from '../run-until-signal.ts'

const LOOPBACK_LISTEN = ['/ip4/127.0.0.1/udp/0/quic-v1', '/ip4/127.0.0.1/tcp/0']

function intOption (value: string, name: string, min: number, max: number): number {
  const n = Number(value)
  if (!Number.isInteger(n) || n < min || n > max) throw new ExitError(`--${name}: expected an integer from ${min} to ${max}, got "${value}"`)
  return n
}

export async function demo (opts: { nodes: string, port: string }): Promise<void> {
  const count = intOption(opts.nodes, 'nodes', 1, 16)
  const port = intOption(opts.port, 'port', 1, 65535 - count)
  const { createThrowawayCa } = await import('../../certs/index.ts')
  const { createDaemon, ensureDemoReady } = await import('../../daemon/node/index.ts')
  const logger = cliLogger()
  const work = await mkdtemp(join(tmpdir(), 'shoal-demo-'))
  const cleanup = async (): Promise<void> => { await rm(work, { recursive: true, force: true }) }
  const daemons: Array<ReturnType<typeof createDaemon>> = []
  const stopAll = async (): Promise<void> => {
    for (const d of daemons.reverse()) await d.stop().catch(() => {})
    await cleanup()
  }
  try {
    process.stdout.write('shoal: preparing the demo model (random weights; first run generates it)…\n')
    await ensureDemoReady(cacheRoot())
    const ca = await createThrowawayCa(join(work, 'ca'), Array.from({ length: count }, (_, i) => `demo-${i + 1}`))
    let bootstrap: string[] = []
    const urls: string[] = []
    for (const [i, id] of ca.identities.entries()) {
      const config = await configFrom({
        identityDir: id.dir,
        models: [{ dir: 'demo' }],
        api: { host: '127.0.0.1', port: port + i },
        device: 'auto',
        dataDir: join(work, `data-${i + 1}`),
        cacheRoot: cacheRoot(),
        listen: LOOPBACK_LISTEN,
        bootstrap,
        mdns: false,
      })
      const daemon = createDaemon(config, { logger: logger.child({ node: id.name }) })
      daemons.push(daemon)
      const started = await daemon.start().catch(startFailure)
      urls.push(started.apiUrl!)
      if (i === 0) bootstrap = daemon.mesh!.libp2p.getMultiaddrs().map(a => a.toString())
    }
    process.stdout.write(`shoal: demo mesh of ${count} node(s) is up; the demo model has random weights, so its text is noise\n`)
    process.stdout.write(`API: ${urls[0]}/v1   (model "shoal-demo"; every node answers: ${urls.join(' ')})\n`)
    process.stdout.write(`try: curl -s ${urls[0]}/v1/chat/completions -H 'content-type: application/json' -d '{"model":"shoal-demo","messages":[{"role":"user","content":"Hello"}],"max_tokens":16}'\n`)
  } catch (err) {
    await stopAll()
    startFailure(err)
  }
  await runUntilSignal(stopAll)
}
