// The suggester moved to core (the stack file's unknown keys use it too); the CLI's names stay.
export { closest, didYouMean, editDistance } from '@ckpt-gym/core/server';
