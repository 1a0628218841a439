/**
 * `shoal demo`: a local mesh of N daemons on loopback, a demo CA, the built-in demo model on each.
 * Every node has an API (any node serves any request); the first one's URL is the one to use.
 * The CA, the node identities and each node's receipt log live under the cache directory's
 * demo/ and are kept between runs, so the receipts can be checked after the demo stops.
 */
import { existsSync } from 'node:fs'
import { join } from 'node:path'
import { configFrom, startFailure } from '../daemon-config.ts'
import { ExitError } from '../exit-error.ts'
import { resolveLogFormat } from '../logging.ts'
import { cacheRoot } from '../paths.ts'
import { cliLogger, runUntilSignal } from '../run-until-signal.ts'

const LOOPBACK_LISTEN = ['/ip4/127.0.0.1/udp/0/quic-v1', '/ip4/127.0.0.1/tcp/0']

function intOption (value: string, name: string, min: number, max: number): number {
  const n = Number(value)
  if (!Number.isInteger(n) || n < min || n > max) throw new ExitError(`--${name}: expected an integer from ${min} to ${max}, got "${value}"`)
  return n
}

/** The demo's CA and node identities under `dir`, made on first use and reused after. */
async function demoIdentities (dir: string, count: number): Promise<Array<{ name: string, dir: string }>> {
  const { initCa, issueNode } = await import('../../certs/index.ts')
  const caDir = join(dir, 'ca')
  if (!existsSync(join(caDir, 'ca.cert.json'))) await initCa(caDir, { name: 'shoal-demo-ca' })
  const out: Array<{ name: string, dir: string }> = []
  for (let i = 1; i <= count; i++) {
    const name = `demo-${i}`
    const idDir = join(dir, name)
    if (!existsSync(join(idDir, 'node.cert.json'))) await issueNode(caDir, { name, outDir: idDir })
    out.push({ name, dir: idDir })
  }
  return out
}

export async function demo (opts: { nodes: string, port: string, logFormat?: string }): Promise<void> {
  const count = intOption(opts.nodes, 'nodes', 1, 16)
  const port = intOption(opts.port, 'port', 1, 65535 - count)
  const { createDaemon, ensureDemoReady } = await import('../../daemon/node/index.ts')
  const { createProgress } = await import('../../shards/index.ts')
  const logger = cliLogger(resolveLogFormat(opts.logFormat, process.stderr.isTTY === true))
  const work = join(cacheRoot(), 'demo')
  const daemons: Array<ReturnType<typeof createDaemon>> = []
  const stopAll = async (): Promise<void> => {
    for (const d of [...daemons].reverse()) await d.stop().catch(() => {})
  }
  const say = (line: string): void => { process.stdout.write(`shoal: ${line}\n`) }
  let stopped: Promise<void> | undefined
  try {
    let layers: ((done: number, total: number) => void) | undefined
    await ensureDemoReady(cacheRoot(), {
      onGenerate: (dir) => { say(`generating the demo model (random weights; once) into ${dir}`) },
      onCompile: (_dir, dest) => {
        say(`compiling the demo model into ONNX shards (once) into ${dest}`)
        layers = createProgress(say, 'compiling')
      },
      onProgress: (done, total) => { layers?.(done, total) },
    })
    const identities = await demoIdentities(work, count)
    let bootstrap: string[] = []
    const urls: string[] = []
    const dataDirs: string[] = []
    for (const [i, id] of identities.entries()) {
      const dataDir = join(work, `data-${i + 1}`)
      const config = await configFrom({
        identityDir: id.dir,
        models: [{ dir: 'demo' }],
        api: { host: '127.0.0.1', port: port + i },
        device: 'auto',
        dataDir,
        cacheRoot: cacheRoot(),
        listen: LOOPBACK_LISTEN,
        bootstrap,
        mdns: false,
        warmUp: true,
      })
      const daemon = createDaemon(config, { logger: logger.child({ node: id.name }) })
      daemons.push(daemon)
      const started = await daemon.start().catch(startFailure)
      urls.push(started.apiUrl!)
      dataDirs.push(dataDir)
      if (i === 0) bootstrap = daemon.mesh!.libp2p.getMultiaddrs().map(a => a.toString())
    }
    // Signals are caught before the lines that say it is up: whoever reads them may stop it at once.
    stopped = runUntilSignal(stopAll, () => daemons.reduce((n, d) => n + d.inFlight(), 0))
    say(`demo mesh of ${count} node(s) is up; the demo model has random weights, so its text is noise`)
    process.stdout.write(`API: ${urls[0]}/v1   (model "shoal-demo"; every node answers: ${urls.join(' ')})\n`)
    process.stdout.write(`data: ${work} (CA, identities, receipt logs data-1…; kept after Ctrl-C)\n`)
    process.stdout.write(`try: curl -s ${urls[0]}/v1/chat/completions -H 'content-type: application/json' -d '{"model":"shoal-demo","messages":[{"role":"user","content":"Hello"}],"max_tokens":16}'\n`)
    process.stdout.write(`then, after Ctrl-C: shoal receipts verify --data ${dataDirs[0]} --ca ${join(work, 'ca', 'ca.cert.json')}\n`)
  } catch (err) {
    await stopAll()
    startFailure(err)
  }
  await stopped
}
