/**
 * witness — nodes keep each other's receipt logs honest: each signs its log head (count + hash,
 * `shoal.log-head/1`) periodically and hands it to its peers over `/shoal/heads/1.0.0`; each peer
 * keeps the newest head of every other in DATA/witnessed-heads.json. `shoal receipts verify
 * --heads FILE` checks a log against them, so a log whose tail was cut (and head pointer
 * rewritten) fails, as Certificate Transparency's signed tree heads expose a shrunk log.
 */
export { createWitness } from './witness.ts'
export type { Witness, WitnessInit, WitnessComponents } from './witness.ts'
export { WITNESSED_HEADS_FILE } from './store.ts'
export type { HeadOffer } from './store.ts'
export { HEADS_WIRE_VERSION, encodeHeadFrame, decodeHeadFrame } from './wire.ts'
